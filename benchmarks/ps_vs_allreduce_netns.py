"""The seeds' comparison: Horovod's ring all-reduce vs TensorFlow's synchronous all-reduce (mwms) vs parameter
servers, for the Keras digits (hidden 64) and a wider model (hidden 8192: 0.6 M parameters, 2.4 MB a step), on two
simulated hosts joined by a capped link.

Two network namespaces on a bridge (tests/netns.py, as the multi-host tests), each host's link capped with
`tc ... tbf` (default 200mbit); one worker per host for every strategy:
- horovod: `unifit launch --hosts A,B` on host 0, horovodrun reaching host 1 over ssh (an sshd in host 1's
  namespace, as tests/test_multihost.py starts it);
- mwms: `unifit launch --hosts A,B --node-rank R` on each host;
- parameter-server: the same with `--num-ps 1`: a worker and a parameter server on each host, the chief on host 0.

Every run trains the same number of epochs on the same data: the all-reduce strategies take a step of 2 x 32
samples (lr scaled linearly: 0.1), parameter-server a step of 32 samples from one worker (lr 0.05, not scaled), so
an epoch is the same samples in all three. Reported per run: the median training throughput of epochs 2..N (the
metrics' throughput/samples_per_s), the wall time of the whole launch (start-up included) and the final validation
accuracy. Needs root (ip netns) and sshd for horovod. Everything it creates is removed at the end.

    sudo .venv/bin/python benchmarks/ps_vs_allreduce_netns.py [--rate 200mbit] [--epochs 5] [--reps 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_paths import RESULTS  # noqa: E402  (beside this script)

from tests.netns import IFNAME, Cluster  # noqa: E402
from tests.test_multihost import _env, start_sshd  # noqa: E402

STRATEGIES = ("horovod", "mwms", "parameter-server")
MODELS = {"digits (hidden 64)": 64, "wide (hidden 8192)": 8192}
PORT = 29400


def cap(cluster: Cluster, rate: str) -> None:
    for host in range(len(cluster.namespaces)):
        cluster.run(host, "tc", "qdisc", "add", "dev", IFNAME, "root", "tbf", "rate", rate, "burst", "256kb",
                    "latency", "100ms")  # fmt: skip


def launch_args(cluster: Cluster, strategy: str) -> dict[int, list[str]]:
    hosts = ",".join(cluster.addresses)
    if strategy == "horovod":  # horovodrun on host 0 starts both ranks
        return {0: ["--hosts", hosts, "--nproc-per-node", "1"]}
    extra = ["--num-ps", "1"] if strategy == "parameter-server" else []
    return {h: ["--hosts", hosts, "--node-rank", str(h), "--master-port", str(PORT), *extra] for h in (0, 1)}


def run(cluster: Cluster, strategy: str, hidden: int, epochs: int, root: Path, env: dict[str, str]) -> dict:
    fit = ["-c", "examples/digits/keras.yaml", "--trainer.strategy", strategy, "--trainer.root_dir", str(root)]
    fit += ["--trainer.max_epochs", str(epochs), "--module.init_args.hidden", str(hidden)]
    fit += ["--trainer.progress_bar", "false", "--trainer.checkpoint.keep_last_n", "1"]
    started = time.monotonic()
    procs = {
        host: cluster.popen(
            host,
            [sys.executable, "-m", "unifit", "launch", *args, *fit],
            log=root.with_suffix(f".h{host}.log"),
            env=_env(env),
            cwd=REPO,
        )
        for host, args in launch_args(cluster, strategy).items()
    }
    for host, proc in procs.items():
        if proc.wait(900) != 0:
            raise RuntimeError(
                f"{strategy} hidden {hidden}: host {host} failed; see {root.with_suffix(f'.h{host}.log')}"
            )
    wall = time.monotonic() - started
    lines = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == list(range(1, epochs + 1)), lines
    return {
        "samples_per_s": statistics.median(line["throughput/samples_per_s"] for line in lines[1:]),
        "wall_s": wall,
        "val_acc": lines[-1]["val/acc"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", default="200mbit", help="each host's link cap, or 'none'")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--out", default=f"{RESULTS}/ps_vs_allreduce_200mbit.md")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from --out's .json")
    args = parser.parse_args()
    if args.replot:
        return plot(json.loads(Path(args.out).with_suffix(".json").read_text()), Path(args.out).with_suffix(".png"))
    results: dict[tuple[str, str], list[dict]] = {(m, s): [] for m in MODELS for s in STRATEGIES}
    work = Path(tempfile.mkdtemp(prefix="unifit-ps-bench-"))
    with Cluster(2, own_hosts_file=True) as cluster:  # horovod: each host name resolves to its own address
        if args.rate != "none":
            cap(cluster, args.rate)
        env, _ = start_sshd(cluster, 1, work / "ssh")
        for rep in range(args.reps):
            for model, hidden in MODELS.items():
                order = STRATEGIES if rep % 2 == 0 else tuple(reversed(STRATEGIES))
                for strategy in order:
                    root = work / f"{strategy}-{hidden}-{rep}"
                    results[(model, strategy)].append(run(cluster, strategy, hidden, args.epochs, root, env))
                    print(rep, model, strategy, results[(model, strategy)][-1], flush=True)
    write(args, results)


def write(args: argparse.Namespace, results: dict[tuple[str, str], list[dict]]) -> None:
    lines = [
        f"# Horovod vs mwms vs parameter servers: 2 simulated hosts, link cap {args.rate}, Keras digits",
        "",
        f"Command: `sudo .venv/bin/python benchmarks/ps_vs_allreduce_netns.py --rate {args.rate} --epochs {args.epochs} "
        f"--reps {args.reps}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared by every process of both hosts), date "
        f"{time.strftime('%Y-%m-%d')}. One worker per host; parameter-server adds a parameter server on each host "
        "and the chief on host 0. Same epochs and samples for all; medians over reps.",
        "",
        "| model | strategy | train samples/s (epochs 2..N) | wall s (launch to end) | final val/acc |",
        "|---|---|---|---|---|",
    ]
    summary = {}
    for (model, strategy), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("samples_per_s", "wall_s", "val_acc")}
        summary[f"{model} {strategy}"] = {**med, "runs": runs}
        lines.append(
            f"| {model} | {strategy} | {med['samples_per_s']:.0f} | {med['wall_s']:.1f} | {med['val_acc']:.3f} |"
        )
    out = Path(args.out)
    lines += ["", f"![throughput and accuracy per strategy]({out.with_suffix('.png').name})"]
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    plot(summary, out.with_suffix(".png"))
    print("\n".join(lines))


def plot(summary: dict[str, dict], path: Path) -> None:
    """Two panels: training throughput and final validation accuracy, a group of bars per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(STRATEGIES)
    for i, strategy in enumerate(STRATEGIES):
        for ax, key in zip(axes, ("samples_per_s", "val_acc")):
            values = [summary[f"{model} {strategy}"][key] for model in MODELS]
            ax.bar([m + i * width for m in range(len(MODELS))], values, width, label=strategy)
    for ax, title in zip(axes, ("training samples/s (epochs 2..N)", "final val/acc")):
        ax.set_xticks([m + width for m in range(len(MODELS))], list(MODELS))
        ax.set_title(title)
    axes[0].set_yscale("log")  # the small model runs ~10x faster than the wide one
    axes[1].set_ylim(0.8, 1.0)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
