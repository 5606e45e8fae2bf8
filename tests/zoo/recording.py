"""What every zoo driver records in a run, whatever the framework: each micro-batch's loss and the epoch
metrics (Recorder), and a crash a step after a mid-epoch checkpoint (Crash); and the loop that runs a
zoo's runs in one process, recording a refusal or failure and going on (run_all)."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import unifit


class Recorder(unifit.Callback):
    """Every micro-batch's loss on this rank, and the epoch metrics (averaged over every rank)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.epochs: list[dict[str, float]] = []

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        self.losses.append(float(loss))

    def on_epoch_end(self, ctx: Any) -> None:
        self.epochs.append(dict(ctx.state.metrics))


class Crash(unifit.Callback):
    """A checkpoint in the middle of the second epoch, then a crash a step later (its checkpoint stays); with several
    steps per call (Keras' steps_per_execution), at the first calls past those steps."""

    def __init__(self) -> None:
        self.saved_at: int | None = None

    def on_train_batch_end(self, ctx: Any, loss: Any, batch_idx: int) -> None:
        step, per_epoch = ctx.progress.optimizer_step, ctx.progress.steps_per_epoch
        if self.saved_at is None and step >= per_epoch + max(1, per_epoch // 2):
            ctx.save_checkpoint()
            self.saved_at = step
        elif self.saved_at is not None and step > self.saved_at:
            raise SimulatedCrash(f"crashed at step {step} after a checkpoint at step {self.saved_at}")


class SimulatedCrash(RuntimeError):
    pass


def run_all(
    runs: list[tuple[str, str, str]],
    run_one: Callable[[str, str, str], dict[str, Any]],
    save: Callable[[str, Any], None],
    out: Path,
    rank: int,
) -> None:
    """Each (model, precision, kind) in turn; `run_one` returns the record (its "weights" go to `save`,
    the rest to out/rank{rank}.json); an exception is recorded as the run's "error" and the zoo goes on."""
    results: dict[str, Any] = {}
    for name, precision, kind in runs:
        key = f"{name}/{precision}/{kind}"
        try:
            result = run_one(name, precision, kind)
        except Exception as exc:  # a refusal (unifit's one line) or a failure
            print(f"zoo: {key} failed on rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            if not isinstance(exc, unifit.UnifitError):
                traceback.print_exc()
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        save(f"{name}.{precision}.{kind}", result.pop("weights"))
        results[key] = result
        print(f"zoo: {key} done on rank {rank}", file=sys.stderr, flush=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results))


class ZooResults:
    """What one launch of a zoo driver left in `out`: rank -> run key -> record (the tests read this)."""

    def __init__(self, out: Path, world: int) -> None:
        self.out = out
        self.ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]

    def record(self, model: str, precision: str, kind: str = "unifit", rank: int = 0) -> dict:
        return self.ranks[rank][f"{model}/{precision}/{kind}"]
