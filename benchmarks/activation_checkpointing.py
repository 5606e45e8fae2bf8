"""What trainer.activation_checkpointing saves and costs: the memory a training forward keeps for backward, and the
time of a forward + backward, for none / selective / full, on a Hugging Face GPT-2 (transformers' code) in one
process on CPU. The blocks are wrapped by unifit's own function (strategies/activation_checkpointing.py), as a fit
wraps them.

    nice -n 10 env OMP_NUM_THREADS=2 .venv/bin/python benchmarks/activation_checkpointing.py [--reps 7]

Kept memory = the net CPU allocation of the forward's ops (torch's profiler, profile_memory): what is still held
when backward starts (activations, the loss). It does not vary between runs. Step time = the median of `reps`
forward + backward passes after one warm-up (spread: min-max), as a ratio to none's in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from unifit.config.schema import ActivationCheckpointingConfig  # noqa: E402
from unifit.strategies.activation_checkpointing import checkpoint_blocks  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "activation_checkpointing"
LAYERS, WIDTH, HEADS, SEQ, BATCH, VOCAB = 8, 256, 8, 256, 8, 1024


def model(mode: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS)
    config.use_cache = False
    network = GPT2LMHeadModel(config).train()
    checkpoint_blocks(network, ActivationCheckpointingConfig(mode=mode))
    return network


def kept_bytes(network: torch.nn.Module, seqs: torch.Tensor) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        loss = network(input_ids=seqs, labels=seqs).loss
    loss.backward()
    return sum(event.self_cpu_memory_usage for event in profile.key_averages())


def step_times(network: torch.nn.Module, seqs: torch.Tensor, reps: int) -> list[float]:
    times = []
    for rep in range(reps + 1):
        started = time.perf_counter()
        network(input_ids=seqs, labels=seqs).loss.backward()
        if rep:  # the first: warm-up
            times.append(time.perf_counter() - started)
        network.zero_grad(set_to_none=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    seqs = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = {}
    for mode in ("none", "selective", "full"):
        network = model(mode)
        rows[mode] = {"kept_bytes": kept_bytes(network, seqs), "step_s": step_times(network, seqs, args.reps)}
    base_kept, base_step = rows["none"]["kept_bytes"], statistics.median(rows["none"]["step_s"])
    command = (
        f"nice -n 10 env OMP_NUM_THREADS=2 .venv/bin/python benchmarks/activation_checkpointing.py --reps {args.reps}"
    )
    lines = [
        "# Activation checkpointing: memory kept for backward and step time",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, torch {torch.__version__}, Python {platform.python_version()}, CPU, "
        f"{torch.get_num_threads()} torch threads.",
        "",
        f"Model: transformers GPT-2, {LAYERS} blocks, width {WIDTH}, {HEADS} heads, {SEQ} tokens, batch {BATCH} "
        f"({sum(p.numel() for p in model('none').parameters()) / 1e6:.1f} M parameters); the blocks wrapped by "
        "unifit's checkpoint_blocks.",
        "",
        "| mode | kept for backward (MB) | / none | step median (s) | min-max (s) | / none |",
        "|---|---|---|---|---|---|",
    ]
    for mode, row in rows.items():
        median = statistics.median(row["step_s"])
        lines.append(
            f"| {mode} | {row['kept_bytes'] / 1e6:.1f} | {row['kept_bytes'] / base_kept:.3f} | {median:.3f} | "
            f"{min(row['step_s']):.3f}-{max(row['step_s']):.3f} | {median / base_step:.2f} |"
        )
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
