"""What do step checkpoints cost? Mean step time with `checkpoint.every_n_steps` (local disk, and S3 on a
moto server on 127.0.0.1) against the same run without step checkpoints, for an MLP of ~12.5 M float32
parameters (~50 MB; ~100 MB per checkpoint with SGD momentum) on CPU; and the time from SIGTERM to
`unifit launch` (ddp, 2 ranks) until every process of the job has exited.

    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint_cost.py [--reps 3] [--steps 220]

Every run is its own `unifit fit` / `unifit launch` process; the conditions are interleaved (the order
rotates every rep) and each checkpointed run is compared with the no-checkpoint run of the same rep.
Step time = rank 0's wall time from the end of step `--warmup` to the end of step `--warmup + --window`,
divided by `--window` (the window holds `window / every` step checkpoints; the epoch-end checkpoint
falls after it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench_paths import RESULTS  # noqa: E402  (beside this script)

import unifit  # noqa: E402

FEATURES, HIDDEN, CLASSES, BATCH = 256, 2432, 10, 32


class BigMLP(unifit.TrainModule):
    """256-2432-2432-2432-10: 12.47 M parameters (49.9 MB float32)."""

    def __init__(self, samples: int = 8192) -> None:
        super().__init__()
        self.samples = samples
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, CLASSES),
        )

    def train_dataset(self):
        g = torch.Generator().manual_seed(0)
        return torch.randn(self.samples, FEATURES, generator=g), torch.randint(0, CLASSES, (self.samples,), generator=g)

    def val_dataset(self):
        return self.train_dataset()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.001, momentum=0.9)


class StepClock(unifit.Callback):
    """Appends `optimizer_step wall_time` per step to <out_dir>/rank<R>.txt (flushed: it is read while running)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self._file = None

    def on_fit_start(self, ctx) -> None:
        rank = int(os.environ.get("RANK", "0"))
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(self.out_dir) / f"rank{rank}.txt", "a", buffering=1)

    def on_train_batch_end(self, ctx, loss, batch_idx) -> None:
        self._file.write(f"{ctx.progress.optimizer_step} {time.time():.6f}\n")

    def on_teardown(self, ctx) -> None:
        if self._file:
            self._file.close()


# ---------------------------------------------------------------- orchestration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(
    storage: str | None,
    every: int | None,
    steps: int,
    strategy: str,
    root: str,
    clock: str,
    bucket: str,
    endpoint: str,
    check_every: int = 10,
) -> dict:
    checkpoint: dict = {"keep_last_n": 3}
    if every:
        checkpoint["every_n_steps"] = every
    if storage == "s3":
        checkpoint["dir"] = f"s3://{bucket}/{uuid.uuid4().hex[:8]}/ckpt"
    return {
        "module": {"class_path": "benchmarks.checkpoint_cost.BigMLP", "init_args": {"samples": BATCH * steps * 2}},
        "trainer": {
            "strategy": strategy,
            "accelerator": "cpu",
            "max_epochs": 1,
            "batch_size": BATCH,
            "root_dir": root,
            "limit_train_batches": steps,
            "limit_val_batches": 0,
            "progress_bar": False,
            "checkpoint": checkpoint,
            "tensorboard": {"enabled": False},
            "preemption": {"check_every_n_steps": check_every},
            "storage_options": {"endpoint_url": endpoint} if storage == "s3" else {},
            "callbacks": [{"class_path": "benchmarks.checkpoint_cost.StepClock", "init_args": {"out_dir": clock}}],
        },
    }


def start(cfg: dict, nproc: int, workdir: Path) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "exp.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    cmd = [sys.executable, "-m", "unifit", "launch", "--nproc-per-node", str(nproc), "-c", str(workdir / "exp.yaml")]
    if nproc == 1:
        cmd = [sys.executable, "-m", "unifit", "fit", "-c", str(workdir / "exp.yaml")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = open(workdir / "log.txt", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def read_clock(clock: Path, rank: int = 0) -> list[tuple[int, float]]:
    f = clock / f"rank{rank}.txt"
    if not f.exists():
        return []
    rows = []
    for line in f.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((int(parts[0]), float(parts[1])))
    return rows


def step_time(rows: list[tuple[int, float]], warmup: int, window: int) -> dict:
    t = dict(rows)
    intervals = [t[s] - t[s - 1] for s in range(warmup + 1, warmup + window + 1)]
    return {
        "mean_step_s": (t[warmup + window] - t[warmup]) / window,
        "median_step_s": statistics.median(intervals),
        "max_step_s": max(intervals),
    }


def session_alive(sid: int) -> list[int]:
    """Pids (not zombies) whose session is sid."""
    alive = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            alive.append(int(d))
    return alive


def timed_run(name: str, cfg: dict, nproc: int, workdir: Path, warmup: int, window: int) -> dict:
    started = time.time()
    proc = start(cfg, nproc, workdir)
    rc = proc.wait(timeout=900)
    if rc != 0:
        raise SystemExit(f"{name} failed ({rc}):\n" + (workdir / "log.txt").read_text()[-3000:])
    res = step_time(read_clock(workdir / "clock"), warmup, window)
    res.update(wall_s=time.time() - started)
    return res


def sigterm_run(cfg: dict, workdir: Path, at_step: int) -> dict:
    proc = start(cfg, 2, workdir)
    clock = workdir / "clock"
    deadline = time.time() + 600
    while True:
        rows = read_clock(clock)
        if rows and rows[-1][0] >= at_step:
            break
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit("sigterm run ended early:\n" + (workdir / "log.txt").read_text()[-3000:])
        time.sleep(0.05)
    sent_step = rows[-1][0]
    sent = time.time()
    os.kill(proc.pid, signal.SIGTERM)  # to `unifit launch` only, as a scheduler would
    launch_exit = None
    while True:
        if launch_exit is None and proc.poll() is not None:
            launch_exit = time.time() - sent
        if proc.poll() is not None and not session_alive(proc.pid):
            break
        if time.time() - sent > 300:
            os.killpg(proc.pid, signal.SIGKILL)
            raise SystemExit("processes still alive 300 s after SIGTERM")
        time.sleep(0.02)
    all_exit = time.time() - sent
    last = read_clock(clock)[-1][0]
    log = (workdir / "log.txt").read_text()
    return {
        "rc": proc.returncode,
        "sent_at_step": sent_step,
        "stopped_at_step": last,
        "launch_exit_s": launch_exit,
        "all_exited_s": all_exit,
        "preempted_msg": "preempted by SIGTERM" in log,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3, help="interleaved reps of the single-process step-time runs")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--window", type=int, default=200, help="measured steps (single)")
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--ddp-reps", type=int, default=1, help="reps of the ddp 2-rank step-time runs (0: none)")
    p.add_argument("--ddp-window", type=int, default=100)
    p.add_argument("--sigterm-reps", type=int, default=2)
    p.add_argument("--sigterm-every", type=int, default=20, help="every_n_steps in the SIGTERM runs")
    p.add_argument("--sigterm-at", type=int, default=25, help="send SIGTERM once rank 0 finished this step")
    p.add_argument("--out", default=f"{RESULTS}/checkpoint_cost.md")
    p.add_argument("--report-only", action="store_true", help="rewrite the .md from the .json beside --out")
    args = p.parse_args()
    if args.report_only:
        write_report(args, json.loads(Path(args.out).with_suffix(".json").read_text()))
        return
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="unifit-ckpt-cost-"))
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(creds)
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    raw: dict = {"single": [], "ddp": [], "sigterm": []}
    try:
        import s3fs

        for _ in range(150):
            try:
                s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("bench")
                break
            except Exception:
                time.sleep(0.2)
        conds = [("none", None, None), ("local", "local", args.every), ("s3", "s3", args.every)]

        def step_runs(strategy: str, nproc: int, reps: int, window: int) -> None:
            steps = args.warmup + window + 10
            for rep in range(reps):
                order = conds[rep % 3 :] + conds[: rep % 3]
                for name, storage, every in order:
                    wd = tmp / f"{strategy}-{rep}-{name}"
                    cfg = config(storage, every, steps, strategy, str(wd / "run"), str(wd / "clock"), "bench", endpoint)
                    res = timed_run(name, cfg, nproc, wd, args.warmup, window)
                    res.update(rep=rep, cond=name)
                    raw[strategy].append(res)
                    print(
                        strategy,
                        rep,
                        name,
                        {k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()},
                        f"[{time.time() - t0:.0f} s]",
                        flush=True,
                    )

        step_runs("single", 1, args.reps, args.window)
        if args.ddp_reps:
            step_runs("ddp", 2, args.ddp_reps, args.ddp_window)
        for rep in range(args.sigterm_reps):
            for storage in ("local", "s3") if rep % 2 == 0 else ("s3", "local"):
                wd = tmp / f"sigterm-{rep}-{storage}"
                cfg = config(
                    storage, args.sigterm_every, 2000, "ddp", str(wd / "run"), str(wd / "clock"), "bench", endpoint
                )
                res = sigterm_run(cfg, wd, args.sigterm_at)
                res.update(rep=rep, storage=storage)
                raw["sigterm"].append(res)
                print("sigterm", rep, storage, res, f"[{time.time() - t0:.0f} s]", flush=True)
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)  # ~3 GB of checkpoints
    raw["wall_s"] = time.time() - t0
    raw["loadavg_end"] = open("/proc/loadavg").read().split()[0]
    write_report(args, raw)


def summarize(runs: list[dict], cond: str) -> dict:
    mine = [r for r in runs if r["cond"] == cond]
    base = {r["rep"]: r["mean_step_s"] for r in runs if r["cond"] == "none"}
    ratios = [r["mean_step_s"] / base[r["rep"]] for r in mine]
    excess = [(r["mean_step_s"] - base[r["rep"]]) for r in mine]
    return {
        "mean_step_s": statistics.median(r["mean_step_s"] for r in mine),
        "median_step_s": statistics.median(r["median_step_s"] for r in mine),
        "max_step_s": statistics.median(r["max_step_s"] for r in mine),
        "ratios": ratios,
        "ratio": statistics.median(ratios),
        "excess": statistics.median(excess),
        "n": len(mine),
    }


def write_report(args, raw: dict) -> None:
    params = sum(p.numel() for p in BigMLP().parameters())
    cmd = (
        f"nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint_cost.py --reps {args.reps} "
        f"--window {args.window} --every {args.every} --ddp-reps {args.ddp_reps} --ddp-window {args.ddp_window} "
        f"--sigterm-reps {args.sigterm_reps} --sigterm-every {args.sigterm_every} --sigterm-at {args.sigterm_at}"
    )
    lines = [
        "# Checkpoint cost: step checkpoints (local, S3) vs none; SIGTERM to exit",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, Python "
        f"{platform.python_version()}, one torch thread per process, the whole script under `nice -n 10`; "
        f"date {time.strftime('%Y-%m-%d')}; load average at the end {raw.get('loadavg_end', '?')}. "
        f"Script wall time {raw['wall_s'] / 60:.1f} min. S3: moto server on 127.0.0.1 (own process, same machine).",
        "",
        f"Model: MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{HIDDEN}-{CLASSES}, {params / 1e6:.2f} M parameters "
        f"({params * 4 / 1e6:.1f} MB float32; a checkpoint holds weights + SGD momentum, ~{params * 8 / 1e6:.0f} MB), "
        f"batch {BATCH} per rank, CPU. Step time: rank 0, from the end of step {args.warmup} over the next "
        f"window of steps (mean = window wall time / steps, so the checkpoint steps are in it); "
        "ratio = that run / the no-checkpoint run of the same rep (each run its own process, order rotated per rep); "
        "table values are medians over reps.",
        "",
        "Stall per checkpoint = (mean step - median step) x steps measured / checkpoints in the window: the extra "
        "time the checkpoint steps took on the training thread, above a typical step of the same run.",
        "",
        "| strategy | checkpoints | runs | mean step (s) | median step (s) | slowest step (s) | stall per checkpoint (s) | step time vs none (median ratio) | per-rep ratios | target <= 1.05 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdict = {}
    for strategy, window in (("single", args.window), ("ddp", args.ddp_window)):
        runs = raw[strategy]
        if not runs:
            continue
        for cond, label in (
            ("none", "none"),
            ("local", f"local, every {args.every} steps"),
            ("s3", f"S3, every {args.every} steps"),
        ):
            s = summarize(runs, cond)
            meets = "-" if cond == "none" else ("yes" if s["ratio"] <= 1.05 else "**no**")
            verdict[(strategy, cond)] = s
            n_ckpt = window // args.every
            stall = (
                statistics.median(
                    (r["mean_step_s"] - r["median_step_s"]) * window / n_ckpt for r in runs if r["cond"] == cond
                )
                if cond != "none" and n_ckpt
                else None
            )
            lines.append(
                f"| {strategy} ({window} steps measured) | {label} | {s['n']} | {s['mean_step_s']:.4f} | "
                f"{s['median_step_s']:.4f} | {s['max_step_s']:.3f} | "
                f"{'-' if stall is None else format(stall, '.2f')} | {s['ratio']:.3f} | "
                f"{', '.join(f'{r:.3f}' for r in s['ratios'])} | {meets} |"
            )
    lines += [
        "",
        f"SIGTERM to `unifit launch` (ddp, 2 ranks, every_n_steps {args.sigterm_every}, "
        f"preemption.check_every_n_steps 10), sent once rank 0 finished step {args.sigterm_at}; "
        "time until every process of the job's session has exited:",
        "",
        "| checkpoint dir | runs | SIGTERM -> all exited (s), median | per run (s) | launch exit code | stopped at step |",
        "|---|---|---|---|---|---|",
    ]
    for storage in ("local", "s3"):
        rs = [r for r in raw["sigterm"] if r["storage"] == storage]
        if not rs:
            continue
        lines.append(
            f"| {storage} | {len(rs)} | {statistics.median(r['all_exited_s'] for r in rs):.2f} | "
            f"{', '.join(format(r['all_exited_s'], '.2f') for r in rs)} | "
            f"{', '.join(str(r['rc']) for r in rs)} | {', '.join(str(r['stopped_at_step']) for r in rs)} |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(raw, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
