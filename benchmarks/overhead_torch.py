"""What does unifit cost per step? The same model, data, batch size and thread count trained by
(a) a hand-written PyTorch loop, (b) unifit single-process, (c) Lightning's Trainer (progress
bar, logger, checkpointing and model summary off), for a tiny MLP (overhead-bound) and a small
CNN (compute-bound). Runs are interleaved, each in a fresh child process (so peak RSS is its own),
timing one epoch of training steps only (set-up excluded for all three).

    .venv/bin/python benchmarks/overhead_torch.py [--reps 5] [--out benchmarks/results/overhead_torch.md]

unifit runs with its defaults except the progress bar, checkpoints and TensorBoard (like
Lightning's); its NaN guard and metric logging stay on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_modules import lightning_classifier, unifit_classifier  # beside this script

MODELS = {"mlp": {"steps": 2000, "batch": 64}, "cnn": {"steps": 150, "batch": 64}}
RUNNERS = ("raw", "unifit", "lightning")


def build(model: str):
    import torch

    torch.manual_seed(0)
    if model == "mlp":
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        x = torch.randn(MODELS[model]["steps"] * MODELS[model]["batch"], 32)
    else:
        net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 7 * 7, 10))
        x = torch.randn(MODELS[model]["steps"] * MODELS[model]["batch"], 1, 28, 28)
    y = torch.randint(0, 10, (len(x),))
    return net, torch.utils.data.TensorDataset(x, y)


def run_raw(model: str) -> float:
    import torch
    import torch.nn.functional as F

    net, ds = build(model)
    loader = torch.utils.data.DataLoader(ds, batch_size=MODELS[model]["batch"], shuffle=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    start = _clock()
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
    return _clock() - start


def _clock() -> float:
    """CPU time of this (single-threaded) process: what other load on the machine steals
    is not counted, which makes the ratios far less noisy than wall time here."""
    return time.process_time() if CLOCK == "cpu" else time.perf_counter()


CLOCK = os.environ.get("BENCH_CLOCK", "cpu")


class _Timer:
    def on_train_epoch_start(self, *args):
        self.start = _clock()

    def on_train_epoch_end(self, *args):
        self.elapsed = _clock() - self.start


def run_unifit(model: str) -> float:
    import unifit

    net, ds = build(model)

    timer = type("UnifitTimer", (_Timer, unifit.Callback), {})()
    unifit.Trainer(max_epochs=1, batch_size=MODELS[model]["batch"], root_dir="benchmarks/_scratch/unifit",
                   progress_bar=False, checkpoint={"enabled": False}, tensorboard={"enabled": False},
                   callbacks=[timer]).fit(unifit_classifier(net, ds))
    return timer.elapsed


def run_lightning(model: str) -> float:
    import lightning as L
    import torch

    net, ds = build(model)

    timer = type("LightningTimer", (_Timer, L.Callback), {})()
    loader = torch.utils.data.DataLoader(ds, batch_size=MODELS[model]["batch"], shuffle=True)
    L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
              callbacks=[timer], default_root_dir="benchmarks/_scratch/lightning").fit(lightning_classifier(net), loader)
    return timer.elapsed


def child(runner: str, model: str) -> None:
    import torch

    torch.set_num_threads(1)
    elapsed = {"raw": run_raw, "unifit": run_unifit, "lightning": run_lightning}[runner](model)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"steps_per_s": MODELS[model]["steps"] / elapsed, "peak_rss_mb": peak_mb}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/overhead_torch[_wall].md")
    parser.add_argument("--child", nargs=2, metavar=("RUNNER", "MODEL"))
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    args.out = args.out or f"benchmarks/results/overhead_torch{'' if args.clock == 'cpu' else '_wall'}.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_CLOCK": args.clock, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    results: dict[str, dict[str, list[dict]]] = {m: {r: [] for r in RUNNERS} for m in MODELS}
    for rep in range(args.reps):
        for model in MODELS:
            order = RUNNERS if rep % 2 == 0 else tuple(reversed(RUNNERS))  # interleaved, order alternates
            for runner in order:
                out = subprocess.run([sys.executable, __file__, "--child", runner, model], env=env,
                                     capture_output=True, text=True, check=True).stdout
                results[model][runner].append(json.loads(out.strip().splitlines()[-1]))
                print(rep, model, runner, results[model][runner][-1], flush=True)
    lines = ["# Per-step overhead: unifit vs a hand-written loop vs Lightning (CPU, 1 thread)", "",
             f"Command: `.venv/bin/python benchmarks/overhead_torch.py --reps {args.reps} --clock {args.clock}`",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
             f"date {time.strftime('%Y-%m-%d')}; median of {args.reps} interleaved runs, each in its own process; "
             f"clock: {'process CPU time' if args.clock == 'cpu' else 'wall time'} of one training epoch.", "",
             "| model | steps/epoch | raw steps/s | unifit steps/s | Lightning steps/s | unifit/raw | unifit/Lightning | peak RSS MB raw / unifit / Lightning |",
             "|---|---|---|---|---|---|---|---|"]
    summary = {}
    for model, by_runner in results.items():
        med = {r: statistics.median(x["steps_per_s"] for x in by_runner[r]) for r in RUNNERS}
        rss = {r: statistics.median(x["peak_rss_mb"] for x in by_runner[r]) for r in RUNNERS}
        summary[model] = {"steps_per_s": med, "peak_rss_mb": rss, "unifit_over_raw": med["unifit"] / med["raw"],
                          "unifit_over_lightning": med["unifit"] / med["lightning"], "runs": by_runner}
        lines.append(f"| {model} | {MODELS[model]['steps']} | {med['raw']:.0f} | {med['unifit']:.0f} | {med['lightning']:.0f} | "
                     f"{med['unifit'] / med['raw']:.3f} | {med['unifit'] / med['lightning']:.2f} | "
                     f"{rss['raw']:.0f} / {rss['unifit']:.0f} / {rss['lightning']:.0f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
