"""The events of a fit, in the order they happen, and the one dispatcher that calls callbacks.

The fit loop, as pseudocode (`Trainer.fit` follows it line by line):

    setup
    fit_start
    for epoch in range(start_epoch, max_epochs):
        train_epoch_start
        for batch in this rank's shard:
            train_batch_start
            loss = training_step(batch); backward; every k-th micro-batch: optimizer step
            train_batch_end
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
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from unifit.callbacks.base import Callback


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


class Dispatcher:
    """Calls callbacks in list order; only callbacks that override a hook are called for it."""

    def __init__(self, callbacks: Sequence["Callback"], context: Any) -> None:
        from unifit.callbacks.base import Callback

        self.context = context
        self._handlers: dict[Event, list[Callable[..., None]]] = {
            event: [getattr(cb, event.value) for cb in callbacks
                    if getattr(type(cb), event.value) is not getattr(Callback, event.value)]
            for event in Event
        }

    def handlers(self, event: Event) -> list[Callable[..., None]]:
        """The bound hooks for `event` (the loop fetches per-step ones once per epoch)."""
        return self._handlers[event]

    def __call__(self, event: Event, *args: Any) -> None:
        for hook in self._handlers[event]:
            hook(self.context, *args)
