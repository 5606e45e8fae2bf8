"""strategy: horovod, started by horovodrun (or mpirun with an MPI-built Horovod).

Does the steps the Horovod guides list by hand: hvd.init(), pin one device per process by local
rank, scale the LR by the number of workers (unifit's LR policy, as for every strategy), average
gradients (through the framework adapter), broadcast rank 0's initial state, and leave file
writing to rank 0. A collective some rank never joins fails every rank after
trainer.collective_timeout_s through Horovod's stall inspector instead of hanging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, ContextManager, Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, PositiveFloat

from unifit.errors import ConfigError, DistributedError, MissingExtraError, error_prefix, first_line
from unifit.strategies.base import Strategy
from unifit.strategies.watchdog import CollectiveWatchdog

log = logging.getLogger("unifit")


class Binding:
    """Horovod's calls for one framework (horovod.torch or horovod.tensorflow), which its collectives go
    through: each framework's training part (torch_adapter.py, tf_adapter.py) is also its binding."""

    hvd: Any
    errors: tuple[type[BaseException], ...] = (RuntimeError,)  # what a broken collective raises

    def pin_device(self, local_rank: int, accelerator: str) -> None: ...

    def all_reduce(self, values: np.ndarray, op: str, name: str) -> np.ndarray:
        raise NotImplementedError


class HorovodOptions(BaseModel):
    """trainer.strategy_options for horovod (Horovod's own tuning knobs)."""

    model_config = ConfigDict(extra="forbid")
    # None keeps Horovod's own default (and its autotuning, HOROVOD_AUTOTUNE=1)
    fusion_threshold_mb: PositiveFloat | None = None  # HOROVOD_FUSION_THRESHOLD (128): tensors fused per allreduce
    cycle_time_ms: PositiveFloat | None = None  # HOROVOD_CYCLE_TIME (1): how often ready tensors are batched
    compression: Literal["none", "fp16"] = "none"  # gradients sent as float16 halve the bytes on the wire


class HorovodStrategy(Strategy):
    """Framework-neutral Horovod: start-up settings, rank facts, collectives, barriers, errors."""

    name = "horovod"
    Options = HorovodOptions

    _started = False
    watchdog: CollectiveWatchdog | None = None
    adapter: Binding | None = None

    def attach(self, training: Any) -> None:
        self.adapter = training  # the module's framework's part: its Horovod calls are the collectives'

    def setup(self) -> None:
        if self.adapter is None:
            raise ConfigError(
                "trainer.strategy: horovod was created without its training part; create it with "
                "unifit.strategies.registry.create and registry.training"
            )
        self._configure_environment()
        hvd = self.hvd = self.adapter.hvd
        hvd.init()
        self._started = True
        launched = self.env.source != "none"  # what the environment readers found before init
        if self.env.world_size > 1 and hvd.size() == 1:  # e.g. `srun unifit fit`: each would train alone
            raise ConfigError(
                f"trainer.strategy: horovod: this process is one of {self.env.world_size} ({self.env.source}), but "
                "Horovod sees a world of 1, so each would train alone; start the ranks with horovodrun: unifit "
                "launch --nproc-per-node N, see docs/clusters.md"
            )
        self.env = dataclasses.replace(
            self.env,
            rank=hvd.rank(),
            world_size=hvd.size(),
            local_rank=hvd.local_rank(),
            local_world_size=hvd.local_size(),
            node_rank=hvd.cross_rank(),
            source="horovod",
        )
        if hvd.size() == 1 and not launched:
            log.warning(
                "horovod: no launcher environment found (HOROVOD_RANK/OMPI_COMM_WORLD_RANK unset), running a "
                "world of size 1; start N processes with: unifit launch --nproc-per-node N -c <experiment.yaml>"
            )
        self.adapter.pin_device(self.local_rank, self.accelerator)
        self.watchdog = (
            CollectiveWatchdog(self.collective_timeout_s, error_prefix(self.rank)) if self.world_size > 1 else None
        )

    def _configure_environment(self) -> None:
        """Horovod reads its settings from the environment at init; a user's own values win."""
        timeout = max(1, round(self.collective_timeout_s))
        options = self.options
        settings = {
            **(
                {"HOROVOD_FUSION_THRESHOLD": str(int(options.fusion_threshold_mb * 1024 * 1024))}
                if options.fusion_threshold_mb
                else {}
            ),
            **({"HOROVOD_CYCLE_TIME": f"{options.cycle_time_ms:g}"} if options.cycle_time_ms else {}),
            # a missing rank: Horovod's stall inspector warns, then shuts down (unifit's watchdog
            # is what ends a stuck rank: the inspector never fired with gloo in our tests)
            "HOROVOD_STALL_CHECK_TIME_SECONDS": str(max(1, min(60, timeout // 2))),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(timeout),
            "HOROVOD_GLOO_TIMEOUT_SECONDS": str(2 * timeout),  # transport, after the watchdog
        }
        for key, value in settings.items():
            os.environ.setdefault(key, value)

    def teardown(self) -> None:
        """Horovod stays initialized to the end of the process (hvd.init registers its shutdown at exit), as a
        script's own hvd.init() does: a second fit's init is a no-op. Shut down and initialized again, Horovod's
        gloo rendezvous raced (rank 0 connected to a rank-1 port no longer listening: 'Connection refused',
        SIGABRT), once in a few dozen re-inits on a busy machine (the model zoo fits 16 times per process)."""
        if self._started and self.watchdog is not None:
            self.watchdog.close()
        self._started = False

    # ---- collectives ----------------------------------------------------------------------
    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        return self._all_reduce(values, "sum")

    def all_reduce_max(self, values: np.ndarray) -> np.ndarray:
        return self._all_reduce(values, "max")

    def _all_reduce(self, values: np.ndarray, op: str) -> np.ndarray:
        if self.world_size == 1:
            return values
        with self.collective(f"all_reduce {op}"):
            return self.adapter.all_reduce(np.ascontiguousarray(values, dtype=np.float64), op, f"unifit.{op}")

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        with self.collective("all_gather_object"):
            return list(self.hvd.allgather_object(obj, name="unifit.all_gather_object"))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        with self.collective("broadcast_object"):
            return self.hvd.broadcast_object(obj, root_rank=src, name="unifit.broadcast_object")

    def barrier(self, name: str) -> None:
        """A named exchange: a rank that never arrives trips the watchdog, a rank at another barrier
        is named in the error."""
        if self.world_size == 1:
            return
        with self.collective(f"barrier '{name}'"):
            names = list(self.hvd.allgather_object(name, name="unifit.barrier"))
        if len(set(names)) > 1:
            raise DistributedError(
                f"barrier '{name}' on rank {self.rank}: ranks reached different barriers {names}; "
                "every rank must call the same ones in the same order"
            )

    def collective_guard(self, what: str) -> ContextManager[Any]:
        return self.collective(what)

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """A collective that never completes ends this rank after the timeout (the watchdog); one
        that breaks because Horovod shut down (a rank died) ends it with one line."""
        what = f"{what} on rank {self.rank}"
        with self.watchdog.guard(what) if self.watchdog is not None else contextlib.nullcontext():
            try:
                yield
            except self.adapter.errors as exc:
                raise DistributedError(f"{what} failed: {first_line(exc)}; another rank failed, see its error") from exc


def import_horovod(part: str, flag: str) -> Any:
    """horovod.torch / horovod.tensorflow, or an error that says exactly what to install."""
    import importlib

    try:
        return importlib.import_module(f"horovod.{part}")
    except ImportError as exc:
        try:
            import horovod  # noqa: F401
        except ImportError:
            raise MissingExtraError(
                "strategy horovod needs Horovod, which is not installed; fix: bash scripts/build_horovod.sh "
                "<your venv> (builds Horovod 0.28.1 for CPU/gloo with the fixes torch 2.x and TF 2.21 need), or on "
                f"GPUs: HOROVOD_GPU_OPERATIONS=NCCL {flag}=1 pip install --no-cache-dir horovod"
            ) from exc
        raise MissingExtraError(
            f"strategy horovod: Horovod is installed without its {part} part ({exc}); fix: rebuild it with "
            f"{flag}=1, e.g. bash scripts/build_horovod.sh <your venv>"
        ) from exc
