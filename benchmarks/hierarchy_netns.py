"""Does hierarchy pay? ddp vs smddp-like on two simulated nodes joined by a slow link.

Two network namespaces (the "nodes") joined by a veth pair whose bandwidth is capped with
`tc qdisc ... tbf` (netem is not available here); 2 ranks in each namespace talk over loopback
inside their node. A communication-heavy model (benchmarks/hierarchy_train.py) trains with ddp
and with smddp-like, interleaved; the median step time and the ratio are reported.
Needs root (ip netns). Everything it creates is removed at the end, also on failure.

    sudo .venv/bin/python benchmarks/hierarchy_netns.py [--rate 200mbit] [--reps 3]
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

from bench_paths import RESULTS  # beside this script

REPO = Path(__file__).resolve().parents[1]
NS = ("unifit-node0", "unifit-node1")
VETH = ("uf-veth0", "uf-veth1")
ADDR = ("10.231.7.1", "10.231.7.2")


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def create(rate: str) -> None:
    for ns in NS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, dev, addr in zip(NS, VETH, ADDR):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        if rate != "none":
            sh(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "100ms",
            )


def remove() -> None:
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)


def run(strategy: str, port: int) -> dict:
    procs = []
    for node, (ns, dev) in enumerate(zip(NS, VETH)):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        procs.append(
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--nproc-per-node",
                    "2",
                    "--master-addr",
                    ADDR[0],
                    "--master-port",
                    str(port),
                    str(REPO / "benchmarks" / "hierarchy_train.py"),
                    strategy,
                ],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        if proc.returncode:
            raise RuntimeError(f"{strategy} failed:\n{err[-3000:]}")
        outs.append(out)
    return next(json.loads(line) for line in outs[0].splitlines() if line.startswith("{"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", default="200mbit", help="link cap between the nodes, or 'none'")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or f"{RESULTS}/hierarchy_{args.rate}.md")
    remove()
    results: dict[str, list[float]] = {"ddp": [], "smddp-like": []}
    try:
        create(args.rate)
        port = 29650
        for rep in range(args.reps):
            for strategy in ("ddp", "smddp-like") if rep % 2 == 0 else ("smddp-like", "ddp"):
                port += 1
                result = run(strategy, port)
                results[strategy].append(result["median_step_s"])
                print(rep, strategy, round(result["median_step_s"], 3), flush=True)
    finally:
        remove()
    med = {k: statistics.median(v) for k, v in results.items()}
    from benchmarks.hierarchy_train import WIDTH  # noqa: E402

    params = 2 * (WIDTH * WIDTH + WIDTH)
    lines = [
        f"# Hierarchical allreduce: ddp vs smddp-like, 2 simulated nodes x 2 ranks, link cap {args.rate}",
        "",
        f"Command: `sudo .venv/bin/python benchmarks/hierarchy_netns.py --rate {args.rate} --reps {args.reps}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, date {time.strftime('%Y-%m-%d')}. Two network "
        f"namespaces joined by a veth pair capped with tbf ({args.rate}); gloo on CPU, one thread per rank. "
        f"Model: 2 x Linear({WIDTH}, {WIDTH}), {params / 1e6:.1f} M parameters ({params * 4 / 1e6:.1f} MB of gradients "
        "per step), batch 4 per rank, DDP buckets of 25 MB. Median step time after 2 warm-up steps, median over reps.",
        "",
        "| strategy | median step (s) | per rep |",
        "|---|---|---|",
        *[f"| {k} | {med[k]:.3f} | {', '.join(f'{v:.3f}' for v in results[k])} |" for k in results],
        "",
        f"Speed-up of smddp-like over flat ddp (ddp step / smddp-like step): **{med['ddp'] / med['smddp-like']:.2f}x** "
        "(target: >= 1.3x at a 200mbit cap).",
    ]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
