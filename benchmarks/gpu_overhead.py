"""What does unifit cost on a GPU? Two models, each trained by (a) a hand-written loop, (b) unifit
single-process, (c) Lightning's Trainer, in 32-true and bf16-mixed:

- resnet18: torchvision's ResNet-18 (10 classes) on 32x32 synthetic images, batch 256;
- transformer: a small pre-norm Transformer encoder (4 layers, d=256, 4 heads) classifying 128-token
  sequences, batch 64.

The same model and data for all three; the hand loop and Lightning read it through the DataLoader a
hand-written loop uses (shuffle, pin_memory, num_workers), unifit through its own input path (in-memory
data gathered a batch at a time, on the device where it fits: what it does by default). Then the fsdp
step: the transformer under unifit's ddp and fsdp (bf16-mixed) on 1 rank (NCCL) and on 2 ranks sharing
the GPU (share_gpus, gloo), step time and peak memory per rank.

Runs are interleaved, each in its own process; of EPOCHS epochs the first warms up cuDNN and the
allocator, each later one is timed with the GPU synchronized at both ends, and a run's figure is the median
of its timed epochs. The table is rewritten after every rep, so a run cut short still leaves its results.

    python benchmarks/gpu_overhead.py [--reps 2] [--steps N] [--models resnet18,transformer] [--out ...]
    python benchmarks/gpu_overhead.py --smoke      # CPU, 2 steps a run, models without torchvision: checks the script

Reports samples/s and peak GPU memory (torch.cuda.max_memory_allocated) per runner, and the ratios
unifit/raw and unifit/Lightning (medians over reps). Needs CUDA, torchvision (resnet18), lightning.
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
from bench_paths import RESULTS, SCRATCH  # beside this script

RUNNERS = ("raw", "unifit", "lightning")
PRECISIONS = ("32-true", "bf16-mixed")
BATCH = {"resnet18": 256, "transformer": 64}
# steps per epoch: the transformer's steps take ~9 ms (bound by kernel launches), so its epochs are longer, or one
# rep's ratio swings by 0.2-0.3 (benchmarks/results/gpu_overhead_transformer_run2.txt)
STEPS = {"resnet18": 60, "transformer": 200}
EPOCHS = 4
SHARDED = (("ddp", 1), ("fsdp", 1), ("ddp", 2), ("fsdp", 2))  # (strategy, ranks on the one GPU)
SEQUENCE, VOCAB = 128, 4096
DEVICE = "cuda"  # --smoke: "cpu"


def build(model: str, steps: int):
    import torch

    torch.manual_seed(0)
    n = steps * BATCH[model]
    if model == "resnet18":
        import torchvision

        net = torchvision.models.resnet18(num_classes=10)
        x = torch.randn(n, 3, 32, 32)
    else:
        net = _transformer()
        x = torch.randint(0, VOCAB, (n, SEQUENCE))
    y = torch.randint(0, 10, (n,))
    return net, torch.utils.data.TensorDataset(x, y)


def _transformer():
    import torch

    class TokenClassifier(torch.nn.Module):
        def __init__(self, d: int = 256) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, d)
            self.position = torch.nn.Parameter(torch.zeros(SEQUENCE, d))
            layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = torch.nn.Linear(d, 10)

        def forward(self, tokens):
            return self.head(self.blocks(self.embed(tokens) + self.position).mean(dim=1))

    return TokenClassifier()


def loader(ds, workers: int, batch: int):
    import torch

    return torch.utils.data.DataLoader(
        ds,
        batch_size=batch,
        shuffle=True,
        pin_memory=DEVICE == "cuda",
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def _now() -> float:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def run_raw(model: str, steps: int, precision: str, workers: int) -> list[float]:
    import contextlib

    import torch
    import torch.nn.functional as F

    net, ds = build(model, steps)
    device = torch.device(DEVICE)
    net.to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    data = loader(ds, workers, BATCH[model])
    autocast = (
        (lambda: torch.autocast(DEVICE, dtype=torch.bfloat16)) if precision == "bf16-mixed" else contextlib.nullcontext
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


def run_unifit(
    model: str, steps: int, precision: str, workers: int, strategy: str = "single", **options
) -> list[float]:
    import unifit

    net, ds = build(model, steps)

    timer = type("UnifitTimer", (_Timer, unifit.Callback), {})()
    unifit.Trainer(
        strategy=strategy,
        strategy_options=options,
        max_epochs=EPOCHS,
        batch_size=BATCH[model],
        lr_scaling="none",
        accelerator="gpu" if DEVICE == "cuda" else "cpu",
        precision=precision,
        num_workers=workers,
        root_dir=f"{SCRATCH}/unifit",
        progress_bar=False,
        checkpoint={"enabled": False},
        tensorboard={"enabled": False},
        callbacks=[timer],
    ).fit(unifit_classifier(net, ds))
    return timer.elapsed[1:]


def run_lightning(model: str, steps: int, precision: str, workers: int) -> list[float]:
    import lightning as L

    net, ds = build(model, steps)

    timer = type("LightningTimer", (_Timer, L.Callback), {})()
    L.Trainer(
        max_epochs=EPOCHS,
        accelerator="gpu" if DEVICE == "cuda" else "cpu",
        devices=1,
        precision=precision,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
        default_root_dir=f"{SCRATCH}/lightning",
    ).fit(lightning_classifier(net), loader(ds, workers, BATCH[model]))
    return timer.elapsed[1:]


def child(runner: str, model: str, precision: str, steps: int, workers: int) -> None:
    import torch

    if runner in ("raw", "unifit", "lightning"):
        run = {"raw": run_raw, "unifit": run_unifit, "lightning": run_lightning}[runner]
        elapsed = run(model, steps, precision, workers)
    else:  # "ddp:2", "fsdp:1": under torchrun, the GPU shared where several ranks
        strategy, ranks = runner.split(":")
        options = {"share_gpus": True} if int(ranks) > 1 else {}
        elapsed = run_unifit(model, steps, precision, workers, strategy, **options)
    cuda = DEVICE == "cuda"
    result = {
        "samples_per_s": steps * BATCH[model] / statistics.median(elapsed),
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0,
    }
    os.write(1, (json.dumps(result) + "\n").encode())  # one write: the ranks' lines never interleave


def _measure(args: argparse.Namespace, env: dict[str, str], runner: str, model: str, precision: str) -> dict:
    """One run in its own process(es): the slowest rank's samples/s (a step waits for every rank) and the
    largest rank's peak memory."""
    steps = args.steps or STEPS[model]
    script = [__file__, "--child", runner, model, precision, "--steps", str(steps), "--workers", str(args.workers)]
    script += ["--smoke"] if args.smoke else []
    if ":" in runner:
        ranks = runner.split(":")[1]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks, *script]
    else:
        command = [sys.executable, *script]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        sys.exit(f"{runner} {model} {precision} failed:\n{proc.stderr[-3000:]}")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {
        "samples_per_s": min(x["samples_per_s"] for x in lines),
        "peak_gpu_mb": max(x["peak_gpu_mb"] for x in lines),
    }


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per epoch (default: STEPS)")
    parser.add_argument("--models", default="resnet18,transformer")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers (the same for all runners)")
    parser.add_argument("--out", default=f"{RESULTS}/gpu_overhead.md")
    parser.add_argument(
        "--smoke", action="store_true", help="on CPU, 2 steps a run, the transformer: checks the script"
    )
    parser.add_argument(
        "--runners", default=",".join(RUNNERS), help="which of raw,unifit,lightning (raw and unifit always run)"
    )
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="which of 32-true,bf16-mixed")
    parser.add_argument("--no-sharded", action="store_true", help="skip the ddp/fsdp table (more reps per lease)")
    parser.add_argument("--child", nargs=3, metavar=("RUNNER", "MODEL", "PRECISION"))
    args = parser.parse_args()
    if args.smoke:
        DEVICE = "cpu"
        if not args.child:
            args.reps, args.steps, args.models = 1, 2, "transformer"
            args.out = f"{SCRATCH}/gpu_overhead_smoke.md"
    if args.child:
        return child(*args.child, args.steps, args.workers)
    import torch

    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else f"CPU smoke run ({platform.machine()})"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p
        ),
    }
    models = args.models.split(",")
    started = time.time()
    runners = tuple(r for r in RUNNERS if r in {"raw", "unifit", *args.runners.split(",")})
    results: dict[str, dict[str, list[dict]]] = {
        f"{m} {p}": {r: [] for r in runners} for m in models for p in args.precisions.split(",")
    }
    sharded: dict[str, list[dict]] = {} if args.no_sharded else {f"{s}:{n}": [] for s, n in SHARDED}
    for rep in range(args.reps):
        for model in models:
            for precision in args.precisions.split(","):
                order = runners if rep % 2 == 0 else tuple(reversed(runners))  # interleaved, order alternates
                for runner in order:
                    results[f"{model} {precision}"][runner].append(_measure(args, env, runner, model, precision))
                    print(rep, model, precision, runner, results[f"{model} {precision}"][runner][-1], flush=True)
        if "transformer" in models:
            for runner in sharded:  # empty with --no-sharded
                sharded[runner].append(_measure(args, env, runner, "transformer", "bf16-mixed"))
                print(rep, "transformer bf16-mixed", runner, sharded[runner][-1], flush=True)
        write(args, gpu, results, sharded, rep + 1, time.time() - started)


def write(
    args: argparse.Namespace,
    gpu: str,
    results: dict[str, dict[str, list[dict]]],
    sharded: dict[str, list[dict]],
    reps: int,
    seconds: float,
) -> None:
    import torch

    batches = ", ".join(f"{m} batch {BATCH[m]}" for m in args.models.split(","))
    steps_text = args.steps or ", ".join(f"{STEPS[m]} ({m})" for m in args.models.split(","))
    lines = [
        "# GPU overhead: unifit vs a hand-written loop vs Lightning, and the fsdp step",
        "",
        f"Command: `python benchmarks/gpu_overhead.py --reps {args.reps}{f' --steps {args.steps}' if args.steps else ''} "
        f"--models {args.models} --runners {args.runners} --precisions {args.precisions}"
        f"{' --no-sharded' if args.no_sharded else ''} "
        f"--workers {args.workers}` ({seconds / 60:.1f} min)",
        f"Machine: {gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, Python {platform.python_version()}; "
        f"date {time.strftime('%Y-%m-%d')}; {batches}; median of {reps} interleaved runs, each in its own process; "
        f"each run: median of epochs 2-{EPOCHS} of {steps_text} steps (GPU synchronized at both ends).",
        "",
        "| model, precision | raw samples/s | unifit samples/s | Lightning samples/s | unifit/raw | unifit/raw per rep (median) | unifit/Lightning | peak GPU MB raw / unifit / Lightning |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary: dict[str, dict] = {}
    for case, by_runner in results.items():
        if not by_runner["raw"]:
            continue
        med = {r: statistics.median(x["samples_per_s"] for x in runs) for r, runs in by_runner.items()}
        mem = {r: statistics.median(x["peak_gpu_mb"] for x in runs) for r, runs in by_runner.items()}
        med.setdefault("lightning", float("nan"))  # --runners without lightning: its columns read nan
        mem.setdefault("lightning", float("nan"))
        ratios = [u["samples_per_s"] / r["samples_per_s"] for u, r in zip(by_runner["unifit"], by_runner["raw"])]
        per_rep = statistics.median(ratios)
        over_lightning = [
            u["samples_per_s"] / lt["samples_per_s"]
            for u, lt in zip(by_runner["unifit"], by_runner.get("lightning", []))
        ]
        summary[case] = {
            "samples_per_s": med,
            "peak_gpu_mb": mem,
            "unifit_over_raw": med["unifit"] / med["raw"],
            "unifit_over_raw_per_rep": per_rep,
            "unifit_over_raw_each_rep": ratios,
            "unifit_over_lightning": med["unifit"] / med["lightning"],
            "unifit_over_lightning_each_rep": over_lightning,
            "runs": by_runner,
        }
        lines.append(
            f"| {case} | {med['raw']:.0f} | {med['unifit']:.0f} | {med['lightning']:.0f} | "
            f"{med['unifit'] / med['raw']:.3f} | {per_rep:.3f} | {med['unifit'] / med['lightning']:.3f} | "
            f"{mem['raw']:.0f} / {mem['unifit']:.0f} / {mem['lightning']:.0f} |"
        )
    lines += ["", "unifit/raw of each rep (each pair run back to back, order alternating):"]
    lines += [
        f"- {case}: " + ", ".join(f"{r:.3f}" for r in entry["unifit_over_raw_each_rep"])
        for case, entry in summary.items()
    ]
    if any(entry["unifit_over_lightning_each_rep"] for entry in summary.values()):
        lines += ["", "unifit/Lightning of each rep:"]
        lines += [
            f"- {case}: " + ", ".join(f"{r:.3f}" for r in entry["unifit_over_lightning_each_rep"])
            for case, entry in summary.items()
        ]
    if any(sharded.values()):
        lines += [
            "",
            "The transformer under unifit's ddp and fsdp, bf16-mixed, batch per rank as above (2 ranks: `share_gpus`, "
            "gloo, both on the one GPU; samples/s of the slowest rank, per rank):",
            "",
            "| strategy, ranks | samples/s per rank | peak GPU MB per rank (largest) |",
            "|---|---|---|",
        ]
        for runner, runs in sharded.items():
            if runs:
                speed = statistics.median(x["samples_per_s"] for x in runs)
                memory = statistics.median(x["peak_gpu_mb"] for x in runs)
                lines.append(f"| {runner.replace(':', ', ')} | {speed:.0f} | {memory:.0f} |")
                summary[f"transformer bf16-mixed {runner}"] = {"samples_per_s": speed, "peak_gpu_mb": memory}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
