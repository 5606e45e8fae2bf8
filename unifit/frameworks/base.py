"""The interface the Trainer uses to run a module, whatever its framework."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from unifit.config.schema import TrainerConfig
from unifit.errors import ConfigError
from unifit.frameworks.metrics import MetricCollector
from unifit.strategies.base import Strategy


class Engine(ABC):
    """Runs one module's steps on this process's device, under a strategy."""

    def __init__(self, module: Any, data: Any, strategy: Strategy, training: Any, config: TrainerConfig) -> None:
        self.module = module
        self.data = data
        self.strategy = strategy  # rank facts and collectives
        self.training = training  # the strategy's part for this framework (engines type it: TorchTraining, ...)
        self.config = config
        self.collector = MetricCollector(self.to_numpy)
        module.collect_into(self.collector)  # the module's self.log records here until close()
        # model replicas over all processes (ranks that split one model count once); engines with several per process set it
        self.replicas = strategy.data_parallel_size

    def close(self) -> None:
        """Release what this engine attached to the module (its metric collector), at the end of a run."""
        self.module.collect_into(None)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all replicas (of the first epoch, where accumulation changes): the one
        number LR scaling and logs use."""
        return self.config.batch_size * self.replicas * self.config.accumulation_at(0)

    def _fit_length(self, steps_per_epoch: int | Callable[[int], int]) -> int:
        """The fit's optimizer steps in all (what schedules are sized by: Lightning's estimated_stepping_batches);
        `steps_per_epoch`: a number, or epoch -> its steps where accumulation changes. With trainer.max_steps this
        fit's config takes the epochs they span (all of them when max_epochs was not set, as Lightning's
        max_epochs=-1; else at most max_epochs)."""
        cfg = self.config
        steps_of = steps_per_epoch if callable(steps_per_epoch) else lambda epoch: steps_per_epoch
        if cfg.max_steps is None:
            return sum(steps_of(epoch) for epoch in range(cfg.max_epochs))
        limit = cfg.max_epochs if "max_epochs" in cfg.model_fields_set else None
        epochs, total = 0, 0
        while total < cfg.max_steps and (limit is None or epochs < limit):
            total += steps_of(epochs)
            epochs += 1
        self.config = cfg.model_copy(update={"max_epochs": epochs})
        return min(cfg.max_steps, total)

    @property
    def validates_mid_accumulation(self) -> bool:
        """Whether a validation may run between two micro-batches of an accumulation window (the gradients
        being accumulated survive it)."""
        return False

    @property
    def forks_loader_workers_each_epoch(self) -> bool:
        """Whether each training epoch forks new loader worker processes (a stream's loader with workers): a
        fork copies whatever lock a background thread holds at that moment, so the loop lets its own
        background work (a checkpoint's commit) finish first."""
        return False

    @contextmanager
    def validating(self) -> Iterator[None]:
        """Around one validation inside fit, its hooks included: the model in evaluation mode (where the
        framework has modes) and what is logged in a collector of its own (separate_metrics)."""
        with self.separate_metrics():
            yield

    @contextmanager
    def separate_metrics(self) -> Iterator[None]:
        """A collector of its own for a validation (what the module logs there), so that one run inside a
        training epoch leaves the epoch's training metrics accumulating in theirs."""
        kept = self.collector
        self.collector = MetricCollector(self.to_numpy)
        self.module.collect_into(self.collector)
        try:
            yield
        finally:
            self.collector = kept
            self.module.collect_into(kept)

    @property
    def threads(self) -> int:
        """CPU threads this rank computes with (the launcher shares a node's CPUs out: OMP_NUM_THREADS)."""
        return int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or os.cpu_count() or 1

    def _rank_data(self, data: Any) -> tuple[Any, bool]:
        """(data, already sharded): data split by file (unifit.data.FileShards) is loaded for this rank only."""
        if hasattr(data, "for_rank"):
            return data.for_rank(self.strategy.data_parallel_rank, self.strategy.data_parallel_size), True
        return data, False

    def _stage_data(self, stage: str, source: str) -> tuple[Any, bool]:
        """(data, already sharded) for validate/test/predict, from the provider's `source` method."""
        data = getattr(self.data, source)()
        if data is None:
            raise ConfigError(
                f"{type(self.data).__name__}.{source}() returned None: there is no data to {stage}; define {source}()"
            )
        data, presharded = self._rank_data(data)
        if presharded and stage == "predict":
            raise ConfigError(
                f"{source}(): data split by file has no dataset-wide order to return predictions in; "
                "give one dataset (every rank takes its part of it)"
            )
        return data, presharded

    @abstractmethod
    def setup(self) -> None:
        """Place the model, build optimizers and data loaders, scale the lr, wrap for the strategy."""

    @property
    @abstractmethod
    def batches_per_epoch(self) -> int:
        """Training micro-batches per epoch on this rank."""

    @property
    @abstractmethod
    def has_validation(self) -> bool: ...

    @property
    @abstractmethod
    def optimizer_steps(self) -> int: ...

    # the batches in the item train_batches yielded last: more than one where a call runs several (Keras'
    # steps_per_execution); the loop counts batches, and the engine its optimizer steps, by it
    batches_in_step: int = 1

    @abstractmethod
    def train_batches(self, epoch: int, skip: int = 0) -> Iterable[Any]:
        """This rank's shard of epoch `epoch`, as device batches, starting after its first `skip`
        batches (a mid-epoch resume: they are skipped without being loaded)."""

    @abstractmethod
    def train_step(self, batch: Any, batch_idx: int) -> Any:
        """Forward, backward, and on accumulation boundaries an optimizer step; returns the loss."""

    @abstractmethod
    def val_batches(self) -> Iterable[Any]: ...

    @abstractmethod
    def validation_step(self, batch: Any, batch_idx: int) -> None: ...

    @abstractmethod
    def end_of_epoch(self) -> None:
        """Epoch-interval scheduler steps and the like."""

    def epoch_metrics(self, metrics: dict[str, float], validated: bool) -> None:
        """The epoch's reduced metrics (after validation, if it ran): for metric-driven schedules."""

    def fit_result(self, state: Any) -> Any:
        """What Trainer.fit returns: the final TrainState; a framework whose users expect their own
        (Keras' History) returns that instead."""
        return state

    @abstractmethod
    def current_lrs(self) -> list[float]:
        """Learning rates (per param group) the next optimizer step uses, warmup included."""

    @abstractmethod
    def to_numpy(self, values: list[Any]) -> np.ndarray:
        """Logged values (tensors or numbers) as one float array, synced once."""

    @abstractmethod
    def is_finite(self, value: Any) -> bool: ...

    def finite_probe(self, value: Any) -> Callable[[], bool | None]:
        """Start checking `value` for NaN/inf; the returned function gives the answer, or None
        while the device has not computed it yet (so the check never stalls the device queue)."""
        finite = value is None or self.is_finite(value)  # None: a skipped batch
        return lambda: finite

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and counters, for checkpoints."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    @abstractmethod
    def rng_state(self) -> dict[str, Any]:
        """This rank's random number generator states."""

    @abstractmethod
    def set_rng_state(self, state: dict[str, Any]) -> None: ...

    @abstractmethod
    def seed(self, seed: int) -> None: ...

    def find_lr(self, settings: Any) -> Any:
        """Lightning's learning-rate range test before the first epoch (trainer.lr_find); PyTorch modules."""
        raise ConfigError(
            "trainer.lr_find: the learning-rate range test runs for PyTorch modules; for a Keras module sweep the "
            "lr in a short run of your own (e.g. a LearningRateScheduler callback) and set it"
        )

    def find_batch_size(self, settings: Any) -> int:
        """Lightning's batch size finder before the first epoch (trainer.batch_size_find); PyTorch modules."""
        raise ConfigError(
            "trainer.batch_size_find: the batch size finder runs for PyTorch modules; for a Keras module try a few "
            "batch sizes in short runs of your own and set trainer.batch_size"
        )

    def start_sharded_write(self, state: dict[str, Any], url: str) -> tuple[dict[str, Any], Future | None]:
        """Under a sharded strategy every rank starts writing its shards of this engine's `state` to `url`
        now (in the background: the Future) and the rest is left for `checkpoint_files`; by default
        nothing is sharded."""
        return state, None

    @abstractmethod
    def checkpoint_files(self, payload: dict[str, Any], writer: bool = True) -> dict[str, bytes]:
        """`payload` serialized now (a snapshot), as file name -> bytes, written later (maybe in the
        background). Called on every rank; only the writer's (rank 0's) files are kept."""

    @abstractmethod
    def read_checkpoint(self, fs: Any, directory: str) -> dict[str, Any]: ...

    @abstractmethod
    def model_files(self) -> dict[str, bytes]:
        """The trained model for serving (weights only), as file name -> bytes."""
