"""Host time per batch for in-memory data: unifit's loader (one gather per batch, input_path.GatheredTensors)
against the DataLoader it replaced (the same sampler, default_collate of one sample at a time).

On a GPU this is time the device waits for between small steps; here it is measured without one, the loaders
alone (no step), interleaved reps, each loader's best rep over the epoch's batches. Shapes: CIFAR-like images
(3x32x32 float32 + an int label) and tabular rows (32 floats), at batch 64, 256 and 1024.

    .venv/bin/python benchmarks/input_path.py [--reps 5] [--out benchmarks/results/input_path.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from bench_paths import RESULTS  # beside this script
from torch.utils.data import DataLoader, TensorDataset

from unifit.frameworks.torch import data as tdata

SHAPES = {"image 3x32x32": (3, 32, 32), "tabular 32": (32,)}
BATCHES = (64, 256, 1024)
SAMPLES = 32_768


def one_epoch(loader: DataLoader) -> float:
    loader.sampler.set_epoch(0)
    started = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - started


def loaders(shape: tuple[int, ...], batch: int) -> dict[str, DataLoader]:
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(SAMPLES, *shape, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g))
    unifit = tdata.train_loader(
        dataset, batch_size=batch, world_size=1, rank=0, seed=0, drop_last=False, num_workers=0, pin_memory=False
    )
    per_sample = DataLoader(dataset, batch_size=batch, sampler=unifit.sampler)  # what unifit did before
    return {"per-sample collate": per_sample, "unifit gather": unifit}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=f"{RESULTS}/input_path.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, shape in SHAPES.items():
        for batch in BATCHES:
            runs = loaders(shape, batch)
            times: dict[str, list[float]] = {label: [] for label in runs}
            for _ in range(args.reps):
                for label, loader in runs.items():
                    times[label].append(one_epoch(loader))
            batches = len(runs["unifit gather"])
            best = {label: min(values) for label, values in times.items()}
            rows.append(
                {
                    "data": name,
                    "batch": batch,
                    "per_sample_us_per_batch": 1e6 * best["per-sample collate"] / batches,
                    "gather_us_per_batch": 1e6 * best["unifit gather"] / batches,
                    "speedup": best["per-sample collate"] / best["unifit gather"],
                }
            )
            print(rows[-1], flush=True)
    out = Path(args.out)
    lines = [
        "# Input path: host time per batch, in-memory data (CPU, 1 thread)",
        "",
        f"`.venv/bin/python benchmarks/input_path.py --reps {args.reps}` on {platform.node()} "
        f"({platform.processor() or platform.machine()}), torch {torch.__version__}, {SAMPLES} samples, "
        "best of the interleaved reps.",
        "",
        "| data | batch | per-sample collate (us/batch) | unifit gather (us/batch) | speed-up |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['data']} | {r['batch']} | {r['per_sample_us_per_batch']:.0f} | {r['gather_us_per_batch']:.0f} "
        f"| {r['speedup']:.1f}x |"
        for r in rows
    ]
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
