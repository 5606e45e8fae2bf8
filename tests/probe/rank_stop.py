"""One rank's own code asks to stop (a LightningModule sets trainer.should_stop on rank 1 only, as code reacting to
its own batch does): every rank must stop at the same agreed step, none left waiting for the others. Before that,
rank 0 alone returns -1 from on_train_batch_start at the first epoch's 4th batch: every rank ends that epoch there.
Lightning's EMAWeightAveraging runs along: every rank ends with the same averaged model. After fit, the script's
own writes run once: through unifit.rank_zero_only and `if trainer.is_global_zero`.

How a launched rank ends rides along too: the results are written by an atexit handler from a thread Python
waits for, and an object left on `sys` aborts the process if the interpreter is finalized (where gloo's threads
can abort a finished run): exit 0 shows unifit ran both and then skipped finalization."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch.callbacks import EMAWeightAveraging  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

import unifit  # noqa: E402


class AbortsIfFinalized:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.kill, self.abort = (
            os.kill,
            signal.SIGABRT,
        )  # os may be gone from the module's globals by the time this object is freed

    def __del__(self) -> None:
        self.kill(self.pid, self.abort)


class StopsOnOneRank(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.steps_at_epoch_end: list[int] = []

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if (self.global_rank, self.current_epoch, batch_idx) == (0, 0, 3) else None

    def on_train_epoch_end(self) -> None:
        self.steps_at_epoch_end.append(self.global_step)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 5:
            self.trainer.should_stop = True
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    module = StopsOnOneRank()
    trained = module.layer.weight.detach().clone()
    averaging = EMAWeightAveraging(decay=0.5)
    trainer = unifit.Trainer(
        max_epochs=3,
        root_dir=str(out / "run"),
        progress_bar=False,
        preemption={"check_every_n_steps": 4},
        callbacks=[averaging],
    )
    state = trainer.fit(module)

    @unifit.rank_zero_only
    def save_once(path: Path) -> str:  # a script's own write after fit, which every rank runs
        with path.open("a") as f:
            f.write(f"{trainer.global_rank}/{trainer.world_size}\n")
        return "saved"

    (out / f"rank_zero_only{trainer.global_rank}.txt").write_text(repr(save_once(out / "saved_once.txt")))
    if trainer.is_global_zero:
        torch.save(module.state_dict(), out / "model.pt")
    average = averaging._average_model.module.layer.weight
    rank = int(os.environ.get("RANK", "0"))
    ends = {
        "step": state.global_step,
        "epoch": state.epoch,
        "steps_at_epoch_end": module.steps_at_epoch_end,
        "weights": module.layer.weight.flatten().tolist(),  # the average, copied in at the end (as Lightning)
        "averaged": bool(torch.equal(module.layer.weight, average)) and not torch.equal(module.layer.weight, trained),
    }
    finished: list[bool] = []

    def finish_late() -> None:
        time.sleep(0.5)
        finished.append(True)

    threading.Thread(target=finish_late).start()  # not a daemon: Python's exit waits for it
    atexit.register(lambda: (out / f"rank{rank}.json").write_text(json.dumps({**ends, "thread_done": finished})))
    sys.abort_if_finalized = AbortsIfFinalized()  # type: ignore[attr-defined]
