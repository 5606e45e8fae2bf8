"""Per-rank training-state memory and step time: fsdp and model-parallel (tensor parallelism, TP2 x FSDP and TP4;
pipeline stages, PP2 x 2 replicas, held whole or sharded by FSDP2)
against ddp at 1, 2 and 4 ranks, for a ~100 M parameter MLP (6 x Linear(4096, 4096): 100.7 M parameters, 403 MB
float32) trained with AdamW on CPU.

    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsdp_memory.py [--steps 6] [--ranks 1 2 4] \
        [--layouts ddp fsdp tp2 tp4 pp2 pp2fsdp pp2fsdp-kept]

tp2 / tp4: `model-parallel` with tensor_parallel 2 / 4 and the Megatron pairing of the MLP's Linears (colwise then
rowwise, PLAN below); the ranks left over are data parallel, sharded by FSDP2 (TP2 at 4 ranks: 2 x 2).

Every run is `unifit launch` of the same module (its own processes). State memory = bytes of this rank's
parameters + gradients (counted just before each optimizer step, when they are all there) + optimizer
state (AdamW: two moments), counting the local shards of sharded tensors: what FSDP divides and DDP
replicates. Peak RSS = the process's maximum resident set (getrusage), which also holds the gathered
parameters of the unit being computed, activations and the allocator's slack. Step time = rank 0's
median wall time of the steps after the first two. Target (issue 13): fsdp state <= ddp state / N + 10 %.
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
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import unifit  # noqa: E402

WIDTH, LAYERS, BATCH = 4096, 6, 8
# the Sequential's Linears sit at even indices (ReLUs between): each colwise one feeds the rowwise one after it
PLAN = {f"net.{2 * i}": "colwise" if i % 2 == 0 else "rowwise" for i in range(LAYERS)}
DEFAULT_OUT = str(REPO / "benchmarks" / "results" / "fsdp_memory")
LAYOUTS = {
    "ddp": ("ddp", None, 1),
    "fsdp": ("fsdp", None, 1),
    "tp2": ("model-parallel", {"tensor_parallel": 2, "plan": PLAN}, 2),
    "tp4": ("model-parallel", {"tensor_parallel": 4, "plan": PLAN}, 4),
    # the Sequential split evenly into 2 stages (3 Linears each); the other ranks hold replicas of a stage
    "pp2": ("model-parallel", {"pipeline_parallel": 2}, 2),
    # the same stages built from the blocks: each stage's Linears sharded over its 2 replicas by FSDP2
    "pp2fsdp": ("model-parallel", {"pipeline_parallel": 2, "stages": "blocks"}, 2),
    # ... keeping each stage's gathered weights from forward to backward: fewer gathers, more memory in the step
    "pp2fsdp-kept": ("model-parallel", {"pipeline_parallel": 2, "stages": "blocks", "reshard_after_forward": False}, 2),
}


class WideMLP(unifit.TrainModule):
    """6 x Linear(4096, 4096) with ReLU between: 100.7 M parameters."""

    def __init__(self, samples: int = 64) -> None:
        super().__init__()
        self.samples = samples
        layers: list[torch.nn.Module] = []
        for i in range(LAYERS):
            layers += [torch.nn.Linear(WIDTH, WIDTH)] + ([torch.nn.ReLU()] if i + 1 < LAYERS else [])
        self.net = torch.nn.Sequential(*layers)
        self.state_bytes: list[int] = []

    def train_dataset(self):
        g = torch.Generator().manual_seed(0)
        return torch.randn(self.samples, WIDTH, generator=g), torch.randn(self.samples, WIDTH, generator=g)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-4)
        optimizer.register_step_pre_hook(self._count)
        self.optimizer = optimizer
        return optimizer

    def _count(self, optimizer, args, kwargs) -> None:
        """Parameters + gradients + optimizer state held by this rank, right before the step."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        tensors = params + [p.grad for p in params if p.grad is not None] + state
        self.state_bytes.append(sum(_local(t).numel() * t.element_size() for t in tensors))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class MemoryReport(unifit.Callback):
    """Per rank: the largest state count (after the first step, AdamW's moments exist), peak RSS, step times."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.times, self.last = out_dir, [], 0.0

    def on_train_batch_start(self, ctx, batch, batch_idx) -> None:
        self.last = time.perf_counter()

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        self.times.append(time.perf_counter() - self.last)

    def on_fit_end(self, ctx) -> None:
        report = {
            "rank": ctx.rank,
            "state_bytes": max(ctx.module.state_bytes),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_s": statistics.median(self.times[2:]) if len(self.times) > 2 else self.times[-1],
        }
        Path(self.out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(report))


def run(layout: str, ranks: int, steps: int, work: Path) -> dict:
    strategy, options, tensor_parallel = LAYOUTS[layout]
    out = work / f"{layout}-{ranks}"
    out.mkdir(parents=True)
    replicas = ranks // tensor_parallel
    cfg = {
        "module": {"class_path": "benchmarks.fsdp_memory.WideMLP", "init_args": {"samples": steps * BATCH * replicas}},
        "trainer": {
            "strategy": strategy,
            "max_epochs": 1,
            "batch_size": BATCH,
            "root_dir": str(out / "run"),
            "progress_bar": False,
            "checkpoint": {"enabled": False},
            "tensorboard": {"enabled": False},
            "lr_scaling": "none",
            "collective_timeout_s": 600,
            "callbacks": [{"class_path": "benchmarks.fsdp_memory.MemoryReport", "init_args": {"out_dir": str(out)}}],
            **({"strategy_options": options} if options else {}),
        },
    }
    (out / "exp.yaml").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "unifit", "launch", "--nproc-per-node", str(ranks), "-c", str(out / "exp.yaml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"{layout} x{ranks} failed:\n{done.stderr[-3000:]}")
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {
        "strategy": layout,
        "ranks": ranks,
        "wall_s": round(time.perf_counter() - started, 1),
        "state_mb": max(r["state_bytes"] for r in reports) / 2**20,
        "peak_rss_mb": max(r["peak_rss_bytes"] for r in reports) / 2**20,
        "step_s": next(r["step_s"] for r in reports if r["rank"] == 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            for layout in args.layouts:
                if ranks % LAYOUTS[layout][2] == 0 and (layout == "ddp" or ranks >= LAYOUTS[layout][2]):
                    rows.append(run(layout, ranks, args.steps, Path(tmp)))
                    print(json.dumps(rows[-1]), flush=True)
    write(rows, args)


def write(rows: list[dict], args: argparse.Namespace) -> None:
    by = {(r["strategy"], r["ranks"]): r for r in rows}
    command = "nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsdp_memory.py " + " ".join(
        [f"--steps {args.steps}", "--ranks", *map(str, args.ranks), "--layouts", *args.layouts]
        + ([f"--out {os.path.relpath(args.out, REPO)}"] if args.out != DEFAULT_OUT else [])
    )
    lines = [
        "# Sharded layouts vs ddp: per-rank training-state memory and step time",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, Python "
        f"{platform.python_version()}, gloo on CPU, one torch thread per process; load average at the end "
        f"{os.getloadavg()[0]:.2f}. CPU step times are not GPU figures.",
        "",
        f"Model: {LAYERS} x Linear({WIDTH}, {WIDTH}) (100.7 M parameters, 403 MB float32), AdamW, batch {BATCH} per "
        f"replica, {args.steps} steps. State = parameters + gradients + AdamW moments held by a rank (local shards "
        "of sharded tensors), counted before each optimizer step; peak RSS = the process's maximum resident set. "
        "tp2 at 4 ranks = 2 tensor-parallel x 2 data-parallel (FSDP2); tp4 = tensor parallel only; pp2 at 4 ranks = "
        "2 pipeline stages x 2 replicas (2 micro-batches, 1F1B); pp2fsdp = the same stages built from the blocks, "
        "each stage's blocks sharded over its 2 replicas (FSDP2); pp2fsdp-kept = that with reshard_after_forward: "
        "false.",
        "",
        "| ranks | layout | state (MB) | ddp state (MB) | / ddp | target 1/N + 10 % | met | peak RSS (MB) "
        "| ddp peak RSS (MB) | step (s) | samples/s | ddp samples/s | samples/s / ddp |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (layout, ranks), f in by.items():
        d = by.get(("ddp", ranks))
        if layout == "ddp" or d is None:
            continue
        ratio, target = f["state_mb"] / d["state_mb"], 1 / ranks + 0.10
        # a step trains BATCH samples per replica: tensor-parallel ranks share one replica's
        rate, ddp_rate = BATCH * ranks // LAYOUTS[layout][2] / f["step_s"], BATCH * ranks / d["step_s"]
        lines.append(
            f"| {ranks} | {layout} | {f['state_mb']:.0f} | {d['state_mb']:.0f} | {ratio:.3f} | {target:.3f} | "
            f"{'yes' if ratio <= target else 'no'} | {f['peak_rss_mb']:.0f} | {d['peak_rss_mb']:.0f} | "
            f"{f['step_s']:.2f} | {rate:.1f} | {ddp_rate:.1f} | {rate / ddp_rate:.2f} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
