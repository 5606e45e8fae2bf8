"""The events of a fit, in the order they happen (trainer/dispatcher.py calls the callbacks).

The fit loop, as pseudocode (`Trainer.fit` follows it line by line):

    setup
    fit_start
    for epoch in range(start_epoch, max_epochs):   # with max_steps: the epochs it spans (or fewer)
        train_epoch_start
        for batch in this rank's shard:
            train_batch_start
            loss = training_step(batch); backward; every k-th micro-batch: optimizer step
            train_batch_end                 # at max_steps the epoch ends here (validated, checkpointed)
            every val_check_interval batches: validation_start ... validation_end (as below)
        train_epoch_end                     # train metrics averaged over ranks are known
        if validating this epoch:
            validation_start
            for batch in this rank's validation shard: validation_step(batch)
            validation_end                  # validation metrics averaged over ranks
        epoch_end                           # metrics of the epoch; checkpoint, early stop
    fit_end                                 # only when training finished without error
    exception                               # instead of fit_end, when something raised
    teardown                                # always
"""

from __future__ import annotations

from enum import Enum


class Event(str, Enum):
    """Each value is the name of the Callback method that handles it."""

    SETUP = "on_setup"
    FIT_START = "on_fit_start"
    TRAIN_EPOCH_START = "on_train_epoch_start"
    TRAIN_BATCH_START = "on_train_batch_start"
    TRAIN_BATCH_END = "on_train_batch_end"
    TRAIN_EPOCH_END = "on_train_epoch_end"
    VALIDATION_START = "on_validation_start"
    VALIDATION_END = "on_validation_end"
    EPOCH_END = "on_epoch_end"
    FIT_END = "on_fit_end"
    EXCEPTION = "on_exception"
    TEARDOWN = "on_teardown"
