"""What does unifit cost on a GPU? ResNet-18 (torchvision, 10 classes) on 32x32 synthetic images,
batch 256, trained by (a) a hand-written loop, (b) unifit single-process, (c) Lightning's Trainer,
in 32-true and bf16-mixed. The same model, data and DataLoader settings (shuffle, pin_memory,
num_workers) for all three. Runs are interleaved, each in its own process; of EPOCHS epochs the
first warms up cuDNN and the allocator, each later one is timed with the GPU synchronized at both
ends, and a run's figure is the median of its timed epochs. The table is rewritten after every rep,
so a run cut short still leaves its results.

    python benchmarks/gpu_overhead.py [--reps 3] [--steps 100] [--out benchmarks/results/gpu_overhead.md]

Reports samples/s and peak GPU memory (torch.cuda.max_memory_allocated) per runner, and the
ratios unifit/raw and unifit/Lightning (medians over reps). Needs CUDA, torchvision, lightning.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_modules import lightning_classifier, unifit_classifier  # beside this script

RUNNERS = ("raw", "unifit", "lightning")
PRECISIONS = ("32-true", "bf16-mixed")
BATCH = 256
EPOCHS = 4


def build(steps: int):
    import torch
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(steps * BATCH, 3, 32, 32)
    y = torch.randint(0, 10, (len(x),))
    return net, torch.utils.data.TensorDataset(x, y)


def loader(ds, workers: int):
    import torch

    return torch.utils.data.DataLoader(
        ds, batch_size=BATCH, shuffle=True, pin_memory=True, num_workers=workers, persistent_workers=workers > 0
    )


def _now() -> float:
    import torch

    torch.cuda.synchronize()
    return time.perf_counter()


def run_raw(steps: int, precision: str, workers: int) -> list[float]:
    import contextlib

    import torch
    import torch.nn.functional as F

    net, ds = build(steps)
    device = torch.device("cuda", 0)
    net.to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    data = loader(ds, workers)
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if precision == "bf16-mixed" else contextlib.nullcontext
    )
    elapsed = []
    for _epoch in range(EPOCHS):
        start = _now()
        for x, y in data:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast():
                loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        elapsed.append(_now() - start)
    return elapsed[1:]


class _Timer:
    elapsed: list[float]

    def on_train_epoch_start(self, *args):
        self.start = _now()

    def on_train_epoch_end(self, *args):
        self.elapsed = [*getattr(self, "elapsed", []), _now() - self.start]


def run_unifit(steps: int, precision: str, workers: int) -> list[float]:
    import unifit

    net, ds = build(steps)

    timer = type("UnifitTimer", (_Timer, unifit.Callback), {})()
    unifit.Trainer(
        max_epochs=EPOCHS,
        batch_size=BATCH,
        accelerator="gpu",
        precision=precision,
        num_workers=workers,
        root_dir="benchmarks/_scratch/unifit",
        progress_bar=False,
        checkpoint={"enabled": False},
        tensorboard={"enabled": False},
        callbacks=[timer],
    ).fit(unifit_classifier(net, ds))
    return timer.elapsed[1:]


def run_lightning(steps: int, precision: str, workers: int) -> list[float]:
    import lightning as L

    net, ds = build(steps)

    timer = type("LightningTimer", (_Timer, L.Callback), {})()
    L.Trainer(
        max_epochs=EPOCHS,
        accelerator="gpu",
        devices=1,
        precision=precision,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
        default_root_dir="benchmarks/_scratch/lightning",
    ).fit(lightning_classifier(net), loader(ds, workers))
    return timer.elapsed[1:]


def child(runner: str, precision: str, steps: int, workers: int) -> None:
    import torch

    elapsed = {"raw": run_raw, "unifit": run_unifit, "lightning": run_lightning}[runner](steps, precision, workers)
    print(
        json.dumps(
            {
                "samples_per_s": steps * BATCH / statistics.median(elapsed),
                "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per epoch")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers (the same for all runners)")
    parser.add_argument("--out", default="benchmarks/results/gpu_overhead.md")
    parser.add_argument("--child", nargs=2, metavar=("RUNNER", "PRECISION"))
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.steps, args.workers)
    import torch

    gpu = torch.cuda.get_device_name(0)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p
        ),
    }
    results: dict[str, dict[str, list[dict]]] = {p: {r: [] for r in RUNNERS} for p in PRECISIONS}
    for rep in range(args.reps):
        for precision in PRECISIONS:
            order = RUNNERS if rep % 2 == 0 else tuple(reversed(RUNNERS))  # interleaved, order alternates
            for runner in order:
                proc = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        runner,
                        precision,
                        "--steps",
                        str(args.steps),
                        "--workers",
                        str(args.workers),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if proc.returncode:
                    sys.exit(f"{runner} {precision} failed:\n{proc.stderr[-3000:]}")
                results[precision][runner].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(rep, precision, runner, results[precision][runner][-1], flush=True)
        write(args, gpu, results, rep + 1)


def write(args: argparse.Namespace, gpu: str, results: dict[str, dict[str, list[dict]]], reps: int) -> None:
    import torch

    lines = [
        "# GPU overhead: unifit vs a hand-written loop vs Lightning (ResNet-18, 32x32, batch 256)",
        "",
        f"Command: `python benchmarks/gpu_overhead.py --reps {args.reps} --steps {args.steps} --workers {args.workers}`",
        f"Machine: {gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, Python {platform.python_version()}; "
        f"date {time.strftime('%Y-%m-%d')}; median of {reps} interleaved runs, each in its own process; "
        f"each run: median of epochs 2-{EPOCHS} of {args.steps} steps (GPU synchronized at both ends).",
        "",
        "| precision | raw samples/s | unifit samples/s | Lightning samples/s | unifit/raw | unifit/raw per rep (median) | unifit/Lightning | peak GPU MB raw / unifit / Lightning |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for precision, by_runner in results.items():
        med = {r: statistics.median(x["samples_per_s"] for x in by_runner[r]) for r in RUNNERS}
        mem = {r: statistics.median(x["peak_gpu_mb"] for x in by_runner[r]) for r in RUNNERS}
        per_rep = statistics.median(
            u["samples_per_s"] / r["samples_per_s"] for u, r in zip(by_runner["unifit"], by_runner["raw"])
        )
        summary[precision] = {
            "samples_per_s": med,
            "peak_gpu_mb": mem,
            "unifit_over_raw": med["unifit"] / med["raw"],
            "unifit_over_raw_per_rep": per_rep,
            "unifit_over_lightning": med["unifit"] / med["lightning"],
            "runs": by_runner,
        }
        lines.append(
            f"| {precision} | {med['raw']:.0f} | {med['unifit']:.0f} | {med['lightning']:.0f} | "
            f"{med['unifit'] / med['raw']:.3f} | {per_rep:.3f} | {med['unifit'] / med['lightning']:.3f} | "
            f"{mem['raw']:.0f} / {mem['unifit']:.0f} / {mem['lightning']:.0f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
