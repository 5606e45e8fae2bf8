"""Start-up: what `unifit fit` of the digits example (one process, one epoch) costs over the same work written by
hand, and over the bare imports. Each run is a fresh process, interleaved reps, wall time and peak RSS.

    .venv/bin/python benchmarks/startup.py [--reps 5] [--out benchmarks/results/startup.md]

- imports: `import torch, sklearn.datasets` and loading the digits, nothing else;
- hand loop: those, plus the digits module's network and SGD, one epoch over a DataLoader, nothing saved
  (torch's first optimizer imports torch._dynamo, ~1 s here: any loop pays it);
- unifit fit: `unifit fit -c examples/digits/torch.yaml --trainer.strategy single --trainer.max_epochs 1`,
  the example's defaults (validation, a checkpoint, TensorBoard, metrics.jsonl, the resolved config).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_paths import RESULTS  # beside this script

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

IMPORTS = "import torch, sklearn.datasets; sklearn.datasets.load_digits()"
HAND_LOOP = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
import torch
from examples.digits.data import DigitsData
from examples.digits.torch_module import DigitsClassifier
torch.manual_seed(0)
data = DigitsData()
module = DigitsClassifier(hidden=64, lr=0.05)
optimizer = module.configure_optimizers()
x, y = (torch.as_tensor(a) for a in data.train_dataset())
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
for i, batch in enumerate(loader):
    loss = module.training_step(batch, i)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def unifit_command(root: str) -> list[str]:
    return [
        PYTHON, "-m", "unifit", "fit", "-c", str(REPO / "examples/digits/torch.yaml"), "--trainer.strategy", "single",
        "--trainer.max_epochs", "1", "--trainer.root_dir", root, "--trainer.checkpoint.dir", f"{root}/ckpt",
        "--trainer.tensorboard.log_dir", f"{root}/tb",
    ]  # fmt: skip


def measure(command: list[str]) -> tuple[float, float]:
    """Run `command` from a fresh parent, so its peak RSS is its own."""
    probe = (
        "import resource, subprocess, sys, time, json; t = time.perf_counter(); "
        f"subprocess.run({command!r}, cwd={str(REPO)!r}, check=True, capture_output=True); "
        "print(json.dumps([time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]))"
    )
    out = subprocess.run([PYTHON, "-c", probe], check=True, capture_output=True, text=True).stdout
    wall, rss = json.loads(out)
    return wall, rss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=f"{RESULTS}/startup.md")
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"imports": [], "hand loop": [], "unifit fit": []}
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as root:
            commands = {
                "imports": [PYTHON, "-c", IMPORTS],
                "hand loop": [PYTHON, "-c", HAND_LOOP],
                "unifit fit": unifit_command(root),
            }
            for name, command in commands.items():
                runs[name].append(measure(command))
                print(name, runs[name][-1], flush=True)
    wall = {name: statistics.median(w for w, _ in values) for name, values in runs.items()}
    rss = {name: statistics.median(r for _, r in values) for name, values in runs.items()}
    lines = [
        "# Start-up: unifit fit of the digits example vs the same work by hand (CPU, one process)",
        "",
        f"`.venv/bin/python benchmarks/startup.py --reps {args.reps}` on {platform.node()} "
        f"({platform.machine()}), Python {platform.python_version()}, date {time.strftime('%Y-%m-%d')}; "
        "median of interleaved reps, each a fresh process.",
        "",
        "| run | wall s | peak RSS MB | over imports s | over hand loop s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in runs:
        lines.append(
            f"| {name} | {wall[name]:.2f} | {rss[name]:.0f} | {wall[name] - wall['imports']:+.2f} "
            f"| {wall[name] - wall['hand loop']:+.2f} |"
        )
    out = REPO / args.out
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"runs": runs, "wall": wall, "rss": rss}, indent=1) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
