"""The small Strategy core every distribution strategy implements.

A strategy runs *inside* each process: it knows the rank facts, sets up and tears down
communication, writes and reads checkpoints, and offers the few collectives the Trainer needs.
What it does to train a module of one framework is a training part beside this file (torch_training.py,
keras_training.py), paired with it in the registry's (strategy, framework) table, so this core names no
framework. Collectives take and return NumPy arrays or picklable objects
so callbacks stay framework-neutral; at world size 1 they return their input (one code path).
Starting the processes is a launcher's job (see `launchers/`), not the strategy's.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, ContextManager, Iterator

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from unifit.config.loading import explain
from unifit.errors import ConfigError, DistributedError, UnifitError, first_line
from unifit.strategies.environment import ClusterEnvironment

log = logging.getLogger("unifit")


class NoOptions(BaseModel):
    """A strategy without options accepts none."""

    model_config = ConfigDict(extra="forbid")


class Strategy(ABC):
    """Process-level distribution facts and collectives."""

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = NoOptions
    # For a strategy of your own named by class path (registered strategies have these in their registry
    # row): how `unifit launch` starts its processes, and framework -> the class path of its training part
    # (a class that is itself a TorchTraining/KerasTraining trains that framework; a subclass of a
    # registered strategy inherits its row's).
    launcher: ClassVar[str] = "unifit.strategies.launchers.base:SingleProcessLauncher"
    trainings: ClassVar[dict[str, str | None]] = {}

    def __init__(
        self,
        env: ClusterEnvironment,
        *,
        framework: str = "torch",
        accelerator: str = "auto",
        collective_timeout_s: float = 300.0,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.env = env
        self.framework = framework  # of the module being trained (for messages; the table picks the training part)
        self.accelerator = accelerator
        self.collective_timeout_s = collective_timeout_s
        self.options = self.validate_options(options)

    @classmethod
    def validate_options(cls, options: dict[str, Any] | None) -> BaseModel:
        """trainer.strategy_options as this strategy's Options, or a one-line ConfigError naming the field.
        A classmethod so the experiment is checked when it is loaded, before any process starts."""
        try:
            return cls.Options.model_validate(options or {})
        except ValidationError as exc:
            raise ConfigError(explain(exc, cls.Options, options, prefix="trainer.strategy_options.")) from None

    @classmethod
    def check_launch(cls, options: BaseModel, *, world_size: int, nproc_per_node: int, accelerator: str) -> None:
        """Refuse, before `unifit launch` starts a process, a layout this strategy cannot run (a ConfigError
        that says what to change). What needs the ranks themselves is checked in setup."""

    # ---- rank facts -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def device_index(self) -> int:
        """The GPU this process trains on, where it has one: one per process, by local rank."""
        return self.env.local_rank

    @property
    def is_global_zero(self) -> bool:
        return self.env.rank == 0

    # ---- data parallelism: what the data is split over ---------------------------------
    # Every rank trains a replica of its own, unless several ranks hold parts of one (tensor parallelism):
    # the data, the learning-rate scaling and the logged values then go by replicas, not ranks.
    device_mesh: Any = None  # the ranks' layout (torch DeviceMesh) where a strategy splits the model over ranks

    @property
    def data_parallel_size(self) -> int:
        """The model replicas the data is split over."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's replica: which part of the data it takes (ranks of one replica take the same)."""
        return self.rank

    def reports_metrics(self, rank: int) -> bool:
        """Whether `rank`'s logged values count when they are reduced over ranks: every rank's, unless the ranks of
        one replica compute the same values (tensor parallelism), which then count once."""
        return True

    # ---- life cycle --------------------------------------------------------------------
    def attach(self, training: Any) -> None:
        """The training part made for this strategy's framework (from the registry's table); a strategy
        whose collectives go through that framework's library (Horovod) keeps it. Nothing by default."""

    def claim_process(self) -> None:
        """What the framework must be told before its first operation in this process (TensorFlow's
        logical devices and collectives), done when the Trainer is made: a script that makes its Trainer
        first, before building its model or data, keeps that promise. Nothing by default."""

    def setup(self) -> None:
        """Start communication (process groups, devices). Called once per fit."""

    def teardown(self) -> None:
        """Release what setup made; safe to call after a failed setup."""

    def collective_guard(self, what: str) -> ContextManager[Any]:
        """Around a step that waits on other ranks (a compiled step with an allreduce inside): a
        strategy whose library can wait forever ends it after collective_timeout_s."""
        return contextlib.nullcontext()

    # ---- collectives (no-ops at world size 1) ----------------------------------------
    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        return values

    def all_reduce_max(self, values: np.ndarray) -> np.ndarray:
        return values

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def copy_from_rank_zero(self, tensors: dict[str, Any]) -> None:
        """Rank 0's values of these tensors (buffers each rank updated from its own batches, e.g. BatchNorm's
        running statistics) copied into every rank's, in place."""
        if self.world_size == 1 or not tensors:
            return
        zero = self.broadcast_object({k: v.detach().cpu() for k, v in tensors.items()} if self.is_global_zero else None)
        for key, value in zero.items():
            tensors[key].data.copy_(value)

    def barrier(self, name: str) -> None:
        """Every rank must reach the barrier `name`; one that does not makes it fail, not hang."""

    # ---- state IO ------------------------------------------------------------------------
    def save_checkpoint(
        self, snapshot: Callable[[bool], dict[str, bytes]], commit: Callable[[dict[str, bytes]], None]
    ) -> None:
        """One writer: every rank takes the snapshot (it may run collectives; its argument says
        whether this rank writes), rank 0 commits the files. A sharded strategy overrides this so
        every rank writes its own shards."""
        files = snapshot(self.is_global_zero)
        if self.is_global_zero:
            commit(files)

    def load_checkpoint(
        self, find: Callable[[], tuple[Any, str | None]], read_at: Callable[[str], Any]
    ) -> tuple[Any, str | None]:
        """Rank 0 finds the checkpoint to resume from and reads it: `find()` -> (state, its URL), or
        (None, None) for none. Where every rank can read that URL (a shared disk, S3), each reads its
        own copy; otherwise (rank 0's local disk) rank 0's copy is broadcast. Returns (state, URL)."""
        mine: list[Any] = [None]

        def locate() -> str | None:
            mine[0], url = find()
            return url

        url = self.rank_zero_call(locate)
        if url is None or self.world_size == 1:
            return mine[0], url
        failed: BaseException | None = None
        if not self.is_global_zero:
            try:
                mine[0] = read_at(url)
            except Exception as exc:  # e.g. rank 0's local disk: not there on this host
                failed = exc
        blind = self.all_reduce_max(np.array([float(self.rank) if failed else -1.0]))[0]
        if blind < 0:
            if self.is_global_zero:
                log.info("resume: every rank read %s itself", url)
            return mine[0], url
        if failed is not None:
            log.info(
                "resume: rank %d cannot read %s (%s: %s); rank 0 sends its copy",
                self.rank,
                url,
                type(failed).__name__,
                first_line(failed),
            )
        if self.is_global_zero:
            log.info("resume: not every rank can read %s (rank %d cannot); rank 0 sends its copy", url, int(blind))
        return self.broadcast_object(mine[0] if self.is_global_zero else None), url

    def rank_zero_call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on rank 0 only and give every rank its result, or raise its error on every rank."""
        outcome: tuple[Any, BaseException | None] = (None, None)
        original: Exception | None = None
        if self.is_global_zero:
            try:
                outcome = (fn(), None)
            except UnifitError as exc:
                outcome = (None, exc)
            except Exception as exc:  # every rank must learn about it; rank 0 keeps the original and its cause
                original = exc
                outcome = (None, DistributedError(f"rank 0 failed: {type(exc).__name__}: {first_line(exc)}"))
        value, error = self.broadcast_object(outcome)
        if original is not None:
            raise original
        if error is not None:
            raise error
        return value


class TorchDistributedStrategy(Strategy, ABC):
    """Collectives through torch.distributed, shared by ddp and the strategies built on it.

    unifit's own collectives carry host values (metric sums, flags, pickled objects). Where the
    training backend is not gloo (NCCL), they run on a gloo side group when the backend allows
    one, so they never wait for the GPU's queue; otherwise on CUDA tensors of the pinned device.
    """

    _host_group: Any = None  # set by setup where the backend is not gloo and side groups are allowed

    @classmethod
    def check_launch(cls, options: BaseModel, *, world_size: int, nproc_per_node: int, accelerator: str) -> None:
        """One GPU per rank: more ranks on a node than GPUs visible is refused before torchrun starts them
        (each rank would fail alone, 'local rank 1 has no GPU'), naming the three ways out."""
        super().check_launch(options, world_size=world_size, nproc_per_node=nproc_per_node, accelerator=accelerator)
        if accelerator == "cpu" or getattr(options, "share_gpus", False):
            return
        from unifit.strategies.torch_device import gpus_visible

        gpus = gpus_visible()
        if gpus and nproc_per_node > gpus:
            raise ConfigError(
                f"--nproc-per-node {nproc_per_node}: this machine has {gpus} GPU{'s' if gpus > 1 else ''} and "
                f"{cls.__name__} runs one rank per GPU; launch --nproc-per-node {gpus}, or train on the CPU with "
                "--trainer.accelerator cpu, or share the GPUs (slower, for testing) with --trainer.strategy_options "
                "'{share_gpus: true}'"
            )

    @abstractmethod
    def _group_ready(self) -> bool:
        """Whether a process group exists (false at world size 1)."""

    def _torch(self) -> Any:
        import torch
        import torch.distributed as dist

        return torch, dist

    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        return self._all_reduce(values, "SUM")

    def all_reduce_max(self, values: np.ndarray) -> np.ndarray:
        return self._all_reduce(values, "MAX")

    def _all_reduce(self, values: np.ndarray, op: str) -> np.ndarray:
        if not self._group_ready():
            return values
        torch, dist = self._torch()
        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64)).to(self._collective_device())
        with self._collective(f"all_reduce {op.lower()}"):
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=self._host_group)
        return tensor.cpu().numpy()

    def _collective_device(self) -> Any:
        """gloo takes CPU tensors; NCCL (and smddp) only CUDA tensors of this process's device."""
        torch, dist = self._torch()
        if self._host_group is not None or dist.get_backend() == "gloo":
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self._group_ready():
            return [obj]
        _, dist = self._torch()
        out: list[Any] = [None] * self.world_size
        with self._collective("all_gather_object"):
            dist.all_gather_object(out, obj, group=self._host_group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self._group_ready():
            return obj
        _, dist = self._torch()
        box = [obj]
        with self._collective("broadcast_object"):
            dist.broadcast_object_list(box, src=src, group=self._host_group)
        return box[0]

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """A collective that breaks because another rank died or hung ends this rank with one line."""
        try:
            yield
        except RuntimeError as exc:
            raise DistributedError(
                f"{what} on rank {self.rank} failed: {first_line(exc)}; "
                "another rank failed or stopped calling collectives, see its error"
            ) from exc
