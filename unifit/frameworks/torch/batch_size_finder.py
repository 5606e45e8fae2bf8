"""Lightning's batch size finder (its BatchSizeFinder callback, Tuner.scale_batch_size), before the first epoch.

Trial fits of `steps_per_trial` optimizer steps (and as many validation batches) at growing batch sizes, as
Lightning's `power` and `binsearch` searches grow them: doubled from `init_val` until a trial runs out of memory
(power: then half the failed size; binsearch: then halved intervals between the last good and the failed size,
less `margin`), never past the training set's length or `max_val`. Then the model, optimizers, schedules, step
counter and random states go back to what they were, and the fit trains at the size found: the loaders are made
again, and the fit's steps, warmup and lr scaling follow (the module's `batch_arg_name` attribute, which its own
DataLoader reads, is set to it, as Lightning sets it). One process only, as in Lightning: ranks that run out of
memory at different trials could not agree on their collectives.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable

from unifit.errors import ConfigError

log = logging.getLogger("unifit")

SOURCE = "the batch size finder"


def find_batch_size(engine: Any, settings: Any) -> int:
    """Search on `engine` (a set-up TorchEngine, before its first step), put everything back, train at the size
    found (returned)."""
    if engine.strategy.world_size > 1:
        raise ConfigError(
            f"trainer.batch_size_find: runs on one process ({engine.strategy.world_size} were launched), as "
            "Lightning's BatchSizeFinder; find the per-process batch size with `unifit fit` on one GPU, then set "
            "trainer.batch_size to it for the launch"
        )
    set_size = _setter(engine, settings.batch_arg_name)
    saved = engine.snapshot()
    planned = engine.module.stepping_batches
    stepped, policy = engine.stepped, engine.policy
    engine.stepped = []
    search = _power if settings.mode == "power" else _binsearch
    start = engine.config.batch_size
    try:
        size = search(engine, set_size, settings)
    except BaseException:
        set_size(start)  # the module's attribute as it was
        raise
    finally:
        engine.stepped, engine.policy = stepped, policy
        engine.rewind(saved)
    adopt(engine, size, settings.batch_arg_name, set_size)
    engine.set_rng_state(saved["rng"])  # as before the trials, whatever making the loaders drew
    if engine.strategy.is_global_zero:
        log.info("batch size finder (%s): training at batch size %d", settings.mode, size)
        if engine.schedules and engine.module.stepping_batches != planned:
            log.warning(
                "batch size finder: configure_optimizers() made its schedules when the fit had %d optimizer steps; "
                "at batch size %d it has %d (as in Lightning, a schedule sized by estimated_stepping_batches keeps "
                "its length): set trainer.batch_size to %d for a schedule sized to the fit",
                planned,
                size,
                engine.module.stepping_batches,
                size,
            )
    return size


def adopt(engine: Any, size: int, attribute: str, set_size: Callable[[int], None] | None = None) -> None:
    """Train at the size found (by this fit's search, or by the search of the run a checkpoint resumes): the module's
    `attribute` set, the loaders made again; a checkpoint records both."""
    _resize(engine, set_size or _setter(engine, attribute), size)
    engine.found_batch_size = (size, attribute)


def _power(engine: Any, set_size: Callable[[int], None], settings: Any) -> int:
    """Doubled while trials pass; the first failure halves it and ends the search (Lightning's power scaling)."""
    size = _resize(engine, set_size, settings.init_val)
    any_success = False
    for trial in range(settings.max_trials):
        if size >= settings.max_val:
            break
        if _trial(engine, settings.steps_per_trial):
            if trial + 1 >= settings.max_trials:
                break
            grown = _grown(engine, size, size * 2, settings.max_val)
            if grown == size:
                break
            size, any_success = _resize(engine, set_size, grown), True
        else:
            size = _resize(engine, set_size, max(1, size // 2))
            if any_success:
                break
    return size


def _binsearch(engine: Any, set_size: Callable[[int], None], settings: Any) -> int:
    """Doubled until a trial fails, then halved intervals between the last success and the failure, less the margin
    (Lightning's binsearch scaling)."""
    size = _resize(engine, set_size, settings.init_val)
    low, high, count = 1, None, 0
    while True:
        if size >= settings.max_val:
            break
        if _trial(engine, settings.steps_per_trial):
            count += 1
            if count >= settings.max_trials:
                break
            low = size
            if high is not None and high - low <= 1:
                break
            wanted = (high + low) // 2 if high is not None else size * 2
            grown = _grown(engine, size, wanted, settings.max_val)
            if grown == size:
                break
            size = _resize(engine, set_size, grown)
        else:
            high = size
            size = _resize(engine, set_size, (high + low) // 2)
            if high - low <= 1:
                break
    return max(1, int(size * (1 - settings.margin)))  # the fit's loaders are made at it (adopt)


def _grown(engine: Any, size: int, wanted: int, max_val: int) -> int:
    """The next size to try: no more than max_val, and none (`size`) once a batch holds the whole training set, as
    Lightning stops there; no more than that set either, where Lightning would report a size the loader never
    gives (256 for 200 samples)."""
    samples = _samples(engine)
    if samples is not None and size >= samples:
        return size
    return min(wanted, max_val, samples or wanted)


def _samples(engine: Any) -> int | None:
    if engine.reads_a_stream:  # a stream's loader counts batches, not samples (Lightning caps no iterable data either)
        return None
    try:
        return len(engine.train_loader.dataset)
    except TypeError:  # a stream without a length
        return None


def _trial(engine: Any, steps: int) -> bool:
    """`steps` optimizer steps and as many validation batches at the current size: False where memory ran out."""
    import torch

    engine.policy = type(engine.policy)(factor=engine.policy.factor, warmup_steps=0)  # no warmup in a trial
    try:
        taken, epoch = 0, 0
        while taken < steps:
            for batch_idx, batch in enumerate(engine.train_batches(epoch)):
                before = engine.optimizer_steps
                engine.train_step(batch, batch_idx)
                taken += engine.optimizer_steps != before
                if taken >= steps:
                    break
            epoch += 1
        if engine.has_validation:
            with engine.validating():
                for done, batch in zip(range(steps), engine.val_batches()):
                    engine.validation_step(batch, done)
        return True
    except RuntimeError as exc:
        if not _out_of_memory(exc):
            raise
    finally:
        engine.collector.reset()
    # out of memory; here, past the except block, the failed step's tensors (its traceback's) are released
    if engine.strategy.is_global_zero:
        log.info("batch size finder: batch size %d ran out of memory", engine.config.batch_size)
    engine.abandon_step()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return False


def _out_of_memory(exc: RuntimeError) -> bool:
    """Lightning's is_oom_error: CUDA's out of memory, cuDNN's failure for it, the host allocator's."""
    message = str(exc.args[0]) if len(exc.args) == 1 else ""
    return (
        ("CUDA" in message and "out of memory" in message)
        or "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED" in message
        or "DefaultCPUAllocator: can't allocate memory" in message
    )


def _setter(engine: Any, name: str) -> Callable[[int], None]:
    """Sets the batch size where the module's own DataLoaders read it: on the module, its hparams, its data module and
    theirs, wherever it is (as Lightning looks). A LightningModule must have it somewhere."""
    module = engine.module
    lightning = getattr(module, "lightning", None)
    candidates = [lightning if lightning is not None else module, getattr(module, "datamodule", None)]
    objects, mappings = [], []
    for owner in (c for c in candidates if c is not None):
        if isinstance(getattr(owner, name, None), int):
            objects.append(owner)
        hparams = getattr(owner, "hparams", None)
        if isinstance(hparams, dict) and name in hparams:
            mappings.append(hparams)
    if lightning is not None and not objects and not mappings:
        raise ConfigError(
            f"trainer.batch_size_find.batch_arg_name: {type(lightning).__name__} has no {name!r} (nor its hparams or "
            f"data module), which its DataLoaders would be built with; add self.{name} and build the DataLoaders "
            "from it, or name the attribute that holds the batch size"
        )

    def set_size(size: int) -> None:
        for owner in objects:
            setattr(owner, name, size)
        for mapping in mappings:
            mapping[name] = size

    return set_size


def _resize(engine: Any, set_size: Callable[[int], None], size: int) -> int:
    set_size(size)
    engine.resize(size, SOURCE)
    if engine.config.batch_size != size:
        raise ConfigError(
            f"trainer.batch_size_find: the training DataLoader kept batch size {engine.config.batch_size} when the "
            f"finder set {size}; build it in train_dataloader() from the batch_arg_name attribute (Lightning's finder "
            "cannot resize a DataLoader passed to fit() either), or set trainer.batch_size yourself"
        )
    return size
