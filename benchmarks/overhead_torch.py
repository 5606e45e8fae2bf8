"""What does unifit cost per step? The same model, data, batch size and thread count trained by
(a) a hand-written PyTorch loop, (b) unifit single-process, (c) Lightning's Trainer (progress
bar, logger, checkpointing and model summary off), for a tiny MLP at 500 and at 2000 steps per
epoch (overhead-bound) and a small CNN (compute-bound). Runs are interleaved, each in a fresh
child process (so peak RSS is its own), timing one epoch of training steps only (set-up excluded
for all), by process CPU time and by wall time at once.

    .venv/bin/python benchmarks/overhead_torch.py [--reps 5] [--models tiny,mlp,cnn] [--out benchmarks/results/overhead_torch.md]

unifit runs twice: `minimal` (progress bar, checkpoints and TensorBoard off, like Lightning's
run here; its NaN guard and metric logging stay on) and `defaults` (nothing turned off: NaN guard,
TensorBoard with step scalars, checkpoints, and the progress bar, which unifit shows only on a
terminal, so that child's stderr is a pseudo-terminal). The training epoch is timed from
on_train_epoch_start to on_train_epoch_end (the loader's first batch, the epoch's metric reduce
included); `+ epoch end` adds unifit's work after it (summary line, metrics.jsonl, TensorBoard
flush, the checkpoint), which a hand-written loop does not do.

Timing on a shared machine moves by more than the few percent at stake; `--instructions` counts
instead the instructions each child executes in the same regions under valgrind's callgrind
(needs `valgrind`; ~20 min for tiny; repeatable to ~0.1%, whatever else runs):

    .venv/bin/python benchmarks/overhead_torch.py --instructions --models tiny
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pty
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_modules import lightning_classifier, unifit_classifier  # beside this script
from bench_paths import RESULTS, SCRATCH  # beside this script

# tiny: the size of issue 10's independent measurement (same network as mlp, 500 steps per epoch,
# so per-epoch costs weigh 4x more than at 2000)
MODELS = {"tiny": {"steps": 500, "batch": 64}, "mlp": {"steps": 2000, "batch": 64}, "cnn": {"steps": 150, "batch": 64}}
RUNNERS = ("raw", "unifit", "unifit_defaults", "lightning")
LABELS = {"raw": "raw", "unifit": "unifit minimal", "unifit_defaults": "unifit defaults", "lightning": "Lightning"}


def build(model: str):
    import torch

    torch.manual_seed(0)
    if model in ("tiny", "mlp"):
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        x = torch.randn(MODELS[model]["steps"] * MODELS[model]["batch"], 32)
    else:
        net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 7 * 7, 10),
        )
        x = torch.randn(MODELS[model]["steps"] * MODELS[model]["batch"], 1, 28, 28)
    y = torch.randint(0, 10, (len(x),))
    return net, torch.utils.data.TensorDataset(x, y)


def _clocks() -> tuple[float, float]:
    """(process CPU time, wall time). CPU time of this single-threaded process does not count what
    other load on the machine steals, so its ratios are far less noisy than wall time's."""
    return time.process_time(), time.perf_counter()


MARK = os.environ.get("BENCH_MARK") == "1"


def _mark() -> None:
    """Under `--instructions`, callgrind dumps its counters at every getsid() call (a syscall
    nothing else here makes), so each timed region gets a dump file of its own."""
    if MARK:
        os.getsid(0)


def _since(start: tuple[float, float]) -> dict[str, float]:
    cpu, wall = _clocks()
    return {"cpu": cpu - start[0], "wall": wall - start[1]}


def run_raw(model: str) -> dict[str, dict[str, float]]:
    import torch
    import torch.nn.functional as F

    net, ds = build(model)
    loader = torch.utils.data.DataLoader(ds, batch_size=MODELS[model]["batch"], shuffle=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    _mark()
    start = _clocks()
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
    train = _since(start)
    _mark()
    _mark()  # no epoch-end work: an empty region, so every runner's dumps are numbered alike
    return {"train": train, "epoch": train}


class _Timer:
    """The train epoch, and the epoch with its end-of-epoch callbacks (a unifit timer runs last)."""

    runs_last = True  # unifit: after every other callback, the checkpoint's included

    def on_train_epoch_start(self, *args):
        _mark()
        self.start = _clocks()

    def on_train_epoch_end(self, *args):
        self.train = self.epoch = _since(self.start)
        _mark()

    def on_epoch_end(self, *args):
        self.epoch = _since(self.start)
        _mark()


def run_unifit(model: str, defaults: bool = False) -> dict[str, dict[str, float]]:
    import unifit

    net, ds = build(model)
    timer = type("UnifitTimer", (_Timer, unifit.Callback), {})()
    off = (
        {} if defaults else {"progress_bar": False, "checkpoint": {"enabled": False}, "tensorboard": {"enabled": False}}
    )
    root = f"{SCRATCH}/unifit_{'defaults' if defaults else 'minimal'}"
    unifit.Trainer(max_epochs=1, batch_size=MODELS[model]["batch"], root_dir=root, callbacks=[timer], **off).fit(
        unifit_classifier(net, ds)
    )
    return {"train": timer.train, "epoch": timer.epoch}


def run_lightning(model: str) -> dict[str, dict[str, float]]:
    import lightning as L
    import torch

    net, ds = build(model)

    timer = type("LightningTimer", (_Timer, L.Callback), {})()
    loader = torch.utils.data.DataLoader(ds, batch_size=MODELS[model]["batch"], shuffle=True)
    L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
        default_root_dir=f"{SCRATCH}/lightning",
    ).fit(lightning_classifier(net), loader)
    return {"train": timer.train, "epoch": timer.epoch}


def child(runner: str, model: str) -> None:
    import torch

    torch.set_num_threads(1)
    run = {
        "raw": run_raw,
        "unifit": run_unifit,
        "unifit_defaults": lambda m: run_unifit(m, defaults=True),
        "lightning": run_lightning,
    }[runner]
    times = run(model)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steps = MODELS[model]["steps"]
    print(
        json.dumps(
            {
                "steps_per_s": {clock: steps / times["train"][clock] for clock in ("cpu", "wall")},
                "with_epoch_end_steps_per_s": {clock: steps / times["epoch"][clock] for clock in ("cpu", "wall")},
                "peak_rss_mb": peak_mb,
                "stderr_tty": sys.stderr.isatty(),
            }
        ),
        flush=True,
    )


def spawn(runner: str, model: str, env: dict[str, str]) -> dict:
    """One child process; `unifit_defaults` gets a pseudo-terminal as stderr (its progress bar is
    on, as for a user at a terminal), drained by a thread so the child never blocks on it."""
    cmd = [sys.executable, __file__, "--child", runner, model]
    if runner != "unifit_defaults":
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        out, err = proc.stdout, proc.stderr
    else:
        master, slave = pty.openpty()
        chunks: list[bytes] = []

        def drain() -> None:
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed its end
                    return
                if not data:
                    return
                chunks.append(data)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        out, _ = proc.communicate()
        reader.join(timeout=10)
        os.close(master)
        err = b"".join(chunks).decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{runner} {model} failed (exit {proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _commit() -> str:
    """The unifit commit measured (the checkout this script belongs to; UNIFIT_COMMIT for a copy)."""
    root = Path(__file__).resolve().parents[1]
    found = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--", "unifit"], capture_output=True, text=True
    )
    if found.returncode == 0:
        return found.stdout.strip() + (" (unifit/ modified)" if dirty.stdout.strip() else "")
    return os.environ.get("UNIFIT_COMMIT", "?")


def instructions(runner: str, model: str, env: dict[str, str], scratch: Path) -> dict:
    """One child under callgrind: instructions executed in the training epoch and after it,
    per step. Exact up to ~1% run to run, whatever else loads the machine. The defaults
    runner gets no terminal here (valgrind slows time 50x, so tqdm, which refreshes by time,
    would be counted ~50x too often): its progress bar is off."""
    import re

    out = scratch / f"{runner}-{model}"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("cg.*"):
        old.unlink()
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--dump-before=getsid",
        f"--callgrind-out-file={out}/cg",
        sys.executable,
        __file__,
        "--child",
        runner,
        model,
    ]
    proc = subprocess.run(
        cmd, env={**env, "BENCH_MARK": "1", "PYTHONHASHSEED": "0", "UNIFIT_TTY": "0"}, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{runner} {model} under callgrind failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")

    def total(i: int) -> int:
        path = out / f"cg.{i}"
        if not path.exists():
            return 0
        return int(re.search(r"^(?:summary|totals): (\d+)", path.read_text(), re.M).group(1))

    steps = MODELS[model]["steps"]
    train, end = total(2), total(3)
    return {"train_ir_per_step": train / steps, "with_epoch_end_ir_per_step": (train + end) / steps}


def instructions_report(models: list[str], runners: list[str], env: dict[str, str], jobs: int) -> list[str]:
    from concurrent.futures import ThreadPoolExecutor

    scratch = SCRATCH / "callgrind"
    tasks = [(r, m) for m in models for r in runners]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip(tasks, pool.map(lambda t: instructions(*t, env, scratch), tasks)))
    for (r, m), v in done.items():
        print(m, r, json.dumps(v), flush=True)
    lines = [
        "### instructions (valgrind callgrind; load-independent)",
        "",
        "| model | steps/epoch | "
        + " | ".join(f"{LABELS[r]} Ir/step" for r in runners)
        + " | "
        + " | ".join(f"{LABELS[r]}: raw/it (+ epoch end)" for r in runners if r != "raw")
        + " |",
        "|---|---|" + "---|" * (2 * len(runners) - 1),
    ]
    for m in models:
        raw = done[("raw", m)]
        lines.append(
            f"| {m} | {MODELS[m]['steps']} | "
            + " | ".join(f"{done[(r, m)]['train_ir_per_step']:,.0f}" for r in runners)
            + " | "
            + " | ".join(
                f"{raw['train_ir_per_step'] / done[(r, m)]['train_ir_per_step']:.4f} "
                f"({raw['with_epoch_end_ir_per_step'] / done[(r, m)]['with_epoch_end_ir_per_step']:.4f})"
                for r in runners
                if r != "raw"
            )
            + " |"
        )
    return lines + [
        "",
        "raw/it is the time ratio the instruction counts predict at equal instructions per second; "
        "unifit defaults here without its progress bar (no terminal under callgrind).",
        "",
    ]


def table(results: dict, models: list[str], clock: str, reps: int) -> list[str]:
    lines = [
        f"### {'process CPU time' if clock == 'cpu' else 'wall time'}",
        "",
        "| model | steps/epoch | raw steps/s | unifit minimal | unifit defaults | Lightning | minimal/raw | "
        "defaults/raw | + epoch end: minimal/raw, defaults/raw | unifit minimal/Lightning | unifit - raw us/step (minimal, defaults) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in models:
        by = results[model]
        med = {r: statistics.median(x["steps_per_s"][clock] for x in by[r]) for r in RUNNERS}
        end = {r: statistics.median(x["with_epoch_end_steps_per_s"][clock] for x in by[r]) for r in RUNNERS}
        extra = {r: 1e6 / med[r] - 1e6 / med["raw"] for r in ("unifit", "unifit_defaults")}
        lines.append(
            f"| {model} | {MODELS[model]['steps']} | {med['raw']:.0f} | {med['unifit']:.0f} | {med['unifit_defaults']:.0f} | "
            f"{med['lightning']:.0f} | **{med['unifit'] / med['raw']:.3f}** | **{med['unifit_defaults'] / med['raw']:.3f}** | "
            f"{end['unifit'] / end['raw']:.3f}, {end['unifit_defaults'] / end['raw']:.3f} | "
            f"{med['unifit'] / med['lightning']:.2f} | {extra['unifit']:+.1f}, {extra['unifit_defaults']:+.1f} |"
        )
    rss = {m: {r: statistics.median(x["peak_rss_mb"] for x in results[m][r]) for r in RUNNERS} for m in models}
    if clock == "cpu":
        lines += [
            "",
            "Peak RSS MB (raw / unifit minimal / unifit defaults / Lightning): "
            + "; ".join(f"{m} {' / '.join(f'{rss[m][r]:.0f}' for r in RUNNERS)}" for m in models),
        ]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument(
        "--out",
        default=f"{RESULTS}/overhead_torch.md",
        help="default: benchmarks/results/overhead_torch.md, overhead_torch_instructions.md with --instructions",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per step under valgrind's callgrind instead of timing (slow, exact)",
    )
    parser.add_argument(
        "--runners",
        default="raw,unifit,unifit_defaults",
        help="with --instructions: which runners (lightning is slow to import under valgrind)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="with --instructions: children at once")
    parser.add_argument("--child", nargs=2, metavar=("RUNNER", "MODEL"))
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if args.instructions:
        runners = [r for r in args.runners.split(",") if r]
        if "raw" not in runners or set(runners) - set(RUNNERS):
            parser.error(f"--runners: include raw; choose from {', '.join(RUNNERS)}")
        began = time.perf_counter()
        lines = instructions_report(models, runners, env, args.jobs)
        command = (
            f".venv/bin/python benchmarks/overhead_torch.py --instructions --models {','.join(models)} "
            f"--runners {','.join(runners)}"
        )
        head = [
            "# Per-step overhead in instructions: unifit vs a hand-written loop (CPU, 1 thread)",
            "",
            f"Command: `{command}` ({(time.perf_counter() - began) / 60:.0f} min)",
            f"unifit {_commit()}; machine: {platform.machine()}, Python {platform.python_version()}, {subprocess.run(['valgrind', '--version'], capture_output=True, text=True).stdout.strip()}; "
            f"date {time.strftime('%Y-%m-%d')}; one run each (repeatable to ~0.1%): instructions executed "
            "from on_train_epoch_start to on_train_epoch_end (and to after the epoch-end callbacks), per step.",
            "",
        ]
        default = f"{RESULTS}/overhead_torch_instructions.md"
        out = Path(args.out if args.out != parser.get_default("out") else default)
        out.write_text("\n".join(head + lines))
        print("\n".join(head + lines))
        return
    results: dict[str, dict[str, list[dict]]] = {m: {r: [] for r in RUNNERS} for m in models}
    began = time.perf_counter()
    for rep in range(args.reps):
        for model in models:
            order = RUNNERS if rep % 2 == 0 else tuple(reversed(RUNNERS))  # interleaved, order alternates
            for runner in order:
                results[model][runner].append(spawn(runner, model, env))
                print(rep, model, runner, json.dumps(results[model][runner][-1]), flush=True)
    took = time.perf_counter() - began
    command = f".venv/bin/python benchmarks/overhead_torch.py --reps {args.reps} --models {','.join(models)}"
    lines = [
        "# Per-step overhead: unifit vs a hand-written loop vs Lightning (CPU, 1 thread)",
        "",
        f"Command: `{command}` ({took / 60:.0f} min)",
        f"unifit {_commit()}; machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"date {time.strftime('%Y-%m-%d')}; load average at the end {os.getloadavg()[0]:.1f}; median of {args.reps} "
        "interleaved runs, each in its own process; one training epoch (set-up excluded), steps/s. "
        "unifit minimal: progress bar, checkpoints, TensorBoard off; defaults: all on, stderr a terminal. "
        "`+ epoch end`: until after unifit's epoch-end callbacks (checkpoint included).",
        "",
    ]
    for clock in ("cpu", "wall"):
        lines += table(results, models, clock, args.reps)
    tty = all(x["stderr_tty"] for m in models for x in results[m]["unifit_defaults"])
    lines.append(f"unifit defaults ran with stderr a terminal (progress bar on): {tty}.")
    summary = {"command": command, "minutes": took / 60}
    for model in models:
        by = results[model]
        summary[model] = {
            clock: {"steps_per_s": {r: statistics.median(x["steps_per_s"][clock] for x in by[r]) for r in RUNNERS}}
            for clock in ("cpu", "wall")
        }
        for clock in ("cpu", "wall"):
            s = summary[model][clock]["steps_per_s"]
            summary[model][clock].update({f"{r}_over_raw": s[r] / s["raw"] for r in RUNNERS if r != "raw"})
        summary[model]["peak_rss_mb"] = {r: statistics.median(x["peak_rss_mb"] for x in by[r]) for r in RUNNERS}
        summary[model]["runs"] = by
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
