"""The checkpoint owner: the whole path of a checkpoint, from the snapshot to the commit and back.

    save:   every rank at the barrier; the previous commit done
            every rank's RNG state and partial epoch sums gathered -> a typed Snapshot
            the engine serialises it (under a sharded strategy every rank starts writing its shards)
            rank 0 commits the files, after every shard, on the committer's thread
    resume: rank 0 finds the newest committed checkpoint it can read (else the previous one)
            every rank reads it itself where it can, else receives rank 0's copy
            the Snapshot goes back into the engine, the loop's progress, the callbacks and the RNG

The engine is the serialiser (its state, its files), the strategy decides who writes and reads
(Lightning Fabric's CheckpointIO owned by the strategy); the Trainer only says save and resume.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from unifit.checkpoint.committer import Committer
from unifit.checkpoint.store import CheckpointStore, checkpoint_name
from unifit.config.schema import TrainerConfig
from unifit.errors import ConfigError, first_line
from unifit.frameworks.base import Engine
from unifit.loop.callback import Callback
from unifit.loop.state import Progress, TrainState
from unifit.storage import filesystem
from unifit.strategies.base import Strategy

log = logging.getLogger("unifit")

FORMAT = "unifit/1"


@dataclass(frozen=True)
class Snapshot:
    """What one checkpoint holds; on disk it is the engine's serialisation of `to_payload()`."""

    engine: dict[str, Any]  # the engine's own state (model, optimizer, scheduler, counters; shard locations)
    trainer: TrainState
    rng: list[dict[str, Any]]  # per rank
    collectors: list[dict[str, Any]]  # per rank: the epoch's metric sums so far (mid-epoch only)
    world_size: int
    callbacks: dict[str, dict[str, Any]]  # by callback state key

    def to_payload(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "engine": self.engine,
            "trainer": self.trainer.to_dict(),
            "rng": self.rng,
            "collectors": self.collectors,
            "world_size": self.world_size,
            "callbacks": self.callbacks,
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Snapshot:
        world_size = int(payload["world_size"])
        return cls(
            engine=payload["engine"],
            trainer=TrainState.from_dict(payload["trainer"]),
            rng=list(payload["rng"]),
            collectors=list(payload.get("collectors") or [{}] * world_size),
            world_size=world_size,
            callbacks=dict(payload.get("callbacks", {})),
        )


@dataclass(frozen=True)
class Resumed:
    path: str
    state: TrainState


class Checkpointer:
    """Saves and restores one run's checkpoints (every rank holds one; rank 0 writes)."""

    def __init__(
        self, engine: Engine, strategy: Strategy, config: TrainerConfig, callbacks: Sequence[Callback] = ()
    ) -> None:
        self.engine, self.strategy = engine, strategy
        self.store = CheckpointStore(config.checkpoint_dir, config.storage_options)
        self.storage_options = config.storage_options
        self.seed = config.seed
        self.committer = Committer()
        self.callbacks = _state_keys(callbacks)

    # ---- save ------------------------------------------------------------------------------
    def save(
        self,
        state: TrainState,
        name: str | None = None,
        after_commit: Callable[[CheckpointStore, str], None] | None = None,
    ) -> str:
        """Capture the state now (every rank must call this); rank 0 commits it in the background,
        then runs `after_commit(store, name)`. Returns the checkpoint's location, a local path or a URL (the same
        on every rank)."""
        engine, strategy, store = self.engine, self.strategy, self.store
        strategy.barrier("save_checkpoint")
        self.committer.wait()  # the previous checkpoint is committed before this one may replace it
        mid_epoch = state.progress.batch_in_epoch > 0
        # rank 0's token names the directory every rank writes in
        ranks = strategy.all_gather_object(
            (engine.rng_state(), engine.collector.state_dict() if mid_epoch else {}, uuid.uuid4().hex[:8])
        )
        name = name or checkpoint_name(state.epoch, state.global_step)
        path, directory = store.location(name), store.write_dir(name, ranks[0][2])
        if strategy.is_global_zero:
            store.clear(name)  # before any rank writes its shards there
        # a sharded strategy's ranks start writing their shards now (a snapshot, written in the background)
        engine_state, shards = engine.start_sharded_write(engine.state_dict(), store.fs.unstrip_protocol(directory))
        snapshot = Snapshot(
            engine=engine_state,
            trainer=TrainState.from_dict(state.to_dict()),
            rng=[rng for rng, _, _ in ranks],
            collectors=[collector for _, collector, _ in ranks],
            world_size=strategy.world_size,
            callbacks={key: cb.state_dict() for key, cb in self.callbacks},
        )
        meta = {"epoch": state.epoch, "global_step": state.global_step, "world_size": strategy.world_size}

        def commit(files: dict[str, bytes]) -> None:  # rank 0, on the committer's thread
            def write() -> None:
                if shards is not None:
                    _wait_for_shards(shards, store, directory)  # every rank's, and their index
                store.save(name, lambda fs, d: _write_files(fs, d, files), meta, directory)
                if after_commit is not None:
                    after_commit(store, name)

            self.committer.submit(write)

        strategy.save_checkpoint(lambda writer: engine.checkpoint_files(snapshot.to_payload(), writer=writer), commit)
        if shards is not None and not strategy.is_global_zero:
            self.committer.submit(shards.result)  # its failure is raised at this rank's next save or fit's end
        strategy.barrier("checkpoint_saved")
        return path

    def wait(self) -> None:
        """Until the last checkpoint is committed (raising its error)."""
        self.committer.wait()

    def finish_after(self, error: BaseException) -> None:
        """On failure, still finish a pending commit (the last good state), reporting its own error
        instead of hiding the one that stopped training."""
        try:
            self.committer.wait()
        except Exception as exc:
            log.warning("the last checkpoint could not be committed either: %s: %s", type(exc).__name__, exc)

    # ---- find and read -----------------------------------------------------------------------
    def read(self, spec: str) -> tuple[Snapshot | None, str | None]:
        """(snapshot, path) of the checkpoint `spec` names ('last', 'best', 'auto', a name or a
        directory), the same on every rank; (None, None) when 'auto' finds none. 'last' and 'auto'
        fall back to the previous committed checkpoint when the newest cannot be read."""
        engine, store = self.engine, self.store

        def find() -> tuple[dict[str, Any] | None, str | None]:  # rank 0
            candidates = store.candidates(spec)
            for i, (fs, path) in enumerate(candidates):
                try:
                    return engine.read_checkpoint(fs, path), fs.unstrip_protocol(path).removeprefix("file://")
                except Exception as exc:
                    if i + 1 == len(candidates):
                        raise
                    log.warning(
                        "checkpoint %s cannot be read (%s: %s); using the previous committed one",
                        path,
                        type(exc).__name__,
                        first_line(exc),
                    )
            log.info("--ckpt-path %s: no committed checkpoint in %s; starting fresh", spec, store.url)
            return None, None

        def read_at(url: str) -> dict[str, Any]:  # the other ranks, where they can
            return engine.read_checkpoint(*filesystem(url, self.storage_options))

        payload, path = self.strategy.load_checkpoint(find, read_at)
        return (Snapshot.from_payload(payload), path) if payload is not None else (None, None)

    # ---- resume ------------------------------------------------------------------------------
    def resume(self, spec: str, progress: Progress) -> Resumed | None:
        """Restore the checkpoint `spec` names into the engine, `progress` (this run's sizes; the
        position comes from the checkpoint), the callbacks and the RNG. None: 'auto' found none."""
        engine, strategy = self.engine, self.strategy
        snapshot, path = self.read(spec)
        if snapshot is None or path is None:
            return None
        engine.load_state_dict(snapshot.engine)
        # the engine's batch size may be the checkpoint's (one the batch size finder found): the sizes follow it
        progress.take_sizes(engine.global_batch, engine.batches_per_epoch, engine.config.accumulation_at(0))
        at = snapshot.trainer.progress
        progress.epoch, progress.optimizer_step, progress.samples_seen = at.epoch, at.optimizer_step, at.samples_seen
        if at.batch_in_epoch:
            if (at.batches_per_epoch, snapshot.world_size) != (progress.batches_per_epoch, strategy.world_size):
                raise ConfigError(
                    f"--ckpt-path: {path} was saved mid-epoch by {snapshot.world_size} ranks with "
                    f"{at.batches_per_epoch} batches per epoch each; this run has {strategy.world_size} ranks with "
                    f"{progress.batches_per_epoch}; resume it with the same world size, batch size and data, or "
                    "from a checkpoint taken at an epoch end"
                )
            progress.batch_in_epoch = at.batch_in_epoch
            # the resumed epoch averages all its batches
            engine.collector.load_state_dict(snapshot.collectors[strategy.rank])
        state = TrainState(progress=progress, metrics=snapshot.trainer.metrics)
        for key, cb in self.callbacks:  # older checkpoints keyed callbacks by class name
            cb.load_state_dict(snapshot.callbacks.get(key, snapshot.callbacks.get(type(cb).__name__, {})))
        if snapshot.world_size == strategy.world_size:
            engine.set_rng_state(snapshot.rng[strategy.rank])
        else:
            log.warning(
                "resuming a %d-rank checkpoint on %d ranks: random state is re-seeded, data order is kept",
                snapshot.world_size,
                strategy.world_size,
            )
            engine.seed(self.seed + strategy.data_parallel_rank + 1000 * state.epoch)
        within = f", batch {progress.batch_in_epoch} of epoch {progress.epoch + 1}" if progress.batch_in_epoch else ""
        log.info("resumed from %s (epoch %d, step %d%s)", path, state.epoch, state.global_step, within)
        return Resumed(path, state)


def _state_keys(callbacks: Sequence[Callback]) -> list[tuple[str, Callback]]:
    """A stable key per callback: its state_key, numbered from the second instance on."""
    seen: dict[str, int] = {}
    keyed = []
    for cb in callbacks:
        n = seen[cb.state_key] = seen.get(cb.state_key, 0) + 1
        keyed.append((cb.state_key if n == 1 else f"{cb.state_key}#{n}", cb))
    return keyed


def _wait_for_shards(shards: Future[Any], store: CheckpointStore, directory: str) -> None:
    try:
        shards.result()
    except BaseException:
        store.abandon(directory)
        raise


def _write_files(fs: Any, directory: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        if "/" in name:
            fs.makedirs(f"{directory}/{name.rsplit('/', 1)[0]}", exist_ok=True)
        fs.pipe_file(f"{directory}/{name}", data)
