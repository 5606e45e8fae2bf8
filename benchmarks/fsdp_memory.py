"""Per-rank training-state memory and step time: fsdp against ddp at 1, 2 and 4 ranks, for a ~100 M
parameter MLP (6 x Linear(4096, 4096): 100.7 M parameters, 403 MB float32) trained with AdamW on CPU.

    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsdp_memory.py [--steps 6] [--ranks 1 2 4]

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


def run(strategy: str, ranks: int, steps: int, work: Path) -> dict:
    out = work / f"{strategy}-{ranks}"
    out.mkdir(parents=True)
    cfg = {
        "module": {"class_path": "benchmarks.fsdp_memory.WideMLP", "init_args": {"samples": steps * BATCH * ranks}},
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
        raise SystemExit(f"{strategy} x{ranks} failed:\n{done.stderr[-3000:]}")
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {
        "strategy": strategy,
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
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fsdp_memory"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            for strategy in ("ddp", "fsdp"):
                rows.append(run(strategy, ranks, args.steps, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    write(rows, args)


def write(rows: list[dict], args: argparse.Namespace) -> None:
    by = {(r["strategy"], r["ranks"]): r for r in rows}
    command = "nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsdp_memory.py " + " ".join(
        [f"--steps {args.steps}", "--ranks", *map(str, args.ranks)]
    )
    lines = [
        "# fsdp vs ddp: per-rank training-state memory and step time",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, Python "
        f"{platform.python_version()}, gloo on CPU, one torch thread per process; load average at the end "
        f"{os.getloadavg()[0]:.2f}.",
        "",
        f"Model: {LAYERS} x Linear({WIDTH}, {WIDTH}) (100.7 M parameters, 403 MB float32), AdamW, batch {BATCH} per "
        f"rank, {args.steps} steps. State = parameters + gradients + AdamW moments held by a rank (local shards "
        "for fsdp), counted before each optimizer step; peak RSS = the process's maximum resident set.",
        "",
        "| ranks | ddp state (MB) | fsdp state (MB) | fsdp / ddp | target 1/N + 10 % | met | ddp peak RSS (MB) "
        "| fsdp peak RSS (MB) | ddp step (s) | fsdp step (s) | fsdp / ddp step time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ranks in args.ranks:
        d, f = by[("ddp", ranks)], by[("fsdp", ranks)]
        ratio, target = f["state_mb"] / d["state_mb"], 1 / ranks + 0.10
        lines.append(
            f"| {ranks} | {d['state_mb']:.0f} | {f['state_mb']:.0f} | {ratio:.3f} | {target:.3f} | "
            f"{'yes' if ratio <= target else 'no'} | {d['peak_rss_mb']:.0f} | {f['peak_rss_mb']:.0f} | "
            f"{d['step_s']:.2f} | {f['step_s']:.2f} | {f['step_s'] / d['step_s']:.2f} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
