"""Does S3 slow training down? Epoch time with TensorBoard sync to S3 and a checkpoint to S3
after every epoch, against the same run with local-only storage. S3 is a moto server on
127.0.0.1 in its own process; runs are interleaved in this one process.

    .venv/bin/python benchmarks/s3_overhead.py [--reps 3] [--epochs 6]

Epoch time = from one epoch's start to the next (training, validation, checkpoint, logging).
The first epoch of each run is left out (warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_paths import RESULTS  # beside this script

import unifit  # noqa: E402

HIDDEN, SAMPLES, FEATURES = 1024, 16384, 256


class Model(unifit.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, 10),
        )

    def train_dataset(self):
        g = torch.Generator().manual_seed(0)
        return torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g)

    def val_dataset(self):
        g = torch.Generator().manual_seed(1)
        return torch.randn(2048, FEATURES, generator=g), torch.randint(0, 10, (2048,), generator=g)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class EpochClock(unifit.Callback):
    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_epoch_start(self, ctx) -> None:
        self.marks.append(time.perf_counter())

    def on_fit_end(self, ctx) -> None:
        self.marks.append(time.perf_counter())

    def epoch_times(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])][1:]


def run(storage: str, epochs: int, bucket: str, sync_every: float) -> list[float]:
    clock = EpochClock()
    local = tempfile.mkdtemp(prefix="unifit-bench-")
    tag = uuid.uuid4().hex[:6]
    checkpoint = {"dir": f"s3://{bucket}/{tag}/ckpt"} if storage == "s3" else {}
    tensorboard = {"sync_to": f"s3://{bucket}/{tag}/tb", "sync_every_s": sync_every} if storage == "s3" else {}
    unifit.Trainer(
        max_epochs=epochs,
        batch_size=64,
        root_dir=local,
        progress_bar=False,
        checkpoint=checkpoint,
        tensorboard={**tensorboard, "log_every_n_steps": 10},
        callbacks=[clock],
    ).fit(Model())
    return clock.epoch_times()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument(
        "--sync-every", type=float, default=1.0, help="TensorBoard sync period (s); unifit's default is 30"
    )
    parser.add_argument("--out", default=None, help="default: benchmarks/results/s3_overhead[_syncN].md")
    args = parser.parse_args()
    args.out = args.out or (
        f"{RESULTS}/s3_overhead.md" if args.sync_every == 1.0 else f"{RESULTS}/s3_overhead_sync{args.sync_every:g}.md"
    )
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(env, AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{port}")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    try:
        import s3fs

        for _ in range(100):
            try:
                s3fs.S3FileSystem().mkdir("bench")
                break
            except Exception:
                time.sleep(0.2)
        times: dict[str, list[float]] = {"local": [], "s3": []}
        for rep in range(args.reps):
            for storage in ("local", "s3") if rep % 2 == 0 else ("s3", "local"):
                epoch_times = run(storage, args.epochs, "bench", args.sync_every)
                times[storage] += epoch_times
                print(rep, storage, [round(t, 3) for t in epoch_times], flush=True)
    finally:
        server.kill()
        server.wait()
    params = sum(p.numel() for p in Model().parameters())
    med = {k: statistics.median(v) for k, v in times.items()}
    overhead = med["s3"] / med["local"] - 1
    lines = [
        "# S3 overhead: TensorBoard sync + a checkpoint per epoch to S3 vs local-only storage",
        "",
        f"Command: `.venv/bin/python benchmarks/s3_overhead.py --reps {args.reps} --epochs {args.epochs} "
        f"--sync-every {args.sync_every:g}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch threads 1; date {time.strftime('%Y-%m-%d')}. "
        f"S3: moto server on 127.0.0.1 (own process). Model: MLP {FEATURES}-{HIDDEN}-{HIDDEN}-10, "
        f"{params / 1e6:.2f} M parameters (checkpoint ~{params * 4 * 3 / 2**20:.0f} MB with momentum), "
        f"{SAMPLES} samples/epoch, batch 64; TensorBoard: step scalars every 10 steps, sync every {args.sync_every:g} s.",
        "",
        "| storage | median epoch time (s) | epochs measured |",
        "|---|---|---|",
        f"| local | {med['local']:.3f} | {len(times['local'])} |",
        f"| S3 (checkpoint + TB sync) | {med['s3']:.3f} | {len(times['s3'])} |",
        "",
        f"Overhead: **{overhead * 100:+.1f}%** (target <= 3%).",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(
        json.dumps({"epoch_times": times, "median": med, "overhead": overhead}, indent=1)
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
