"""LR-scaling parity study (Goyal et al. 2017): does N replicas at N x the global batch, with the
learning rate scaled linearly and warmed up, reach the single replica's validation accuracy in the
same number of epochs? And what happens without warmup, or without scaling?

    .venv/bin/python benchmarks/lr_parity.py                      # the whole study (~30 min on 2 busy cores)
    .venv/bin/python benchmarks/lr_parity.py --seeds 5 --teacher-epochs 30 --teacher-train 32768   # bigger

Tasks: `digits` (examples/digits/torch.yaml: the example's MLP, lr 0.05, its data split) and
`teacher` (benchmarks/lr_parity.yaml: a synthetic task that keeps improving for many epochs, see
benchmarks/lr_parity_task.py). Per task, world sizes 1 (the baseline: batch 32, the base lr) and
2, 4, 8 (ddp processes, gloo on CPU, batch 32 per replica, so the global batch is 32N) under three
variants: `linear+warmup` (lr x N, ramped up from the base lr over --warmup-epochs),
`linear, no warmup` and `no scaling` (lr_scaling: none). At the largest world size also a stress trio
(--stress-factor 32: base_batch_size 32N/32, so the lr is x32, with the same warmup, none, and a
--stress-long-warmup 5-epoch one). Every run trains the same number of epochs; several seeds
(trainer.seed: initial weights and data order; the data and its split are fixed).

How runs are started (--launch):
  grouped (default): one torchrun launch per world size (what `unifit launch` hands ddp to), whose
      processes run every run of that world size one after the other, each through unifit's own
      `unifit fit` entry point (unifit.cli.main.main) in a process group the worker opened
      (unifit then leaves the group alone, as documented for a user's group). This saves starting
      about 500 torch processes (78 launches), which on this 2-core machine would cost more than the training itself.
  per-run: every run is its own `python -m unifit launch --nproc-per-node N -c ... ` (slow).
--verify K (default 1) reruns K of the grouped runs through `unifit launch` and compares their
per-epoch metrics, so the shortcut is shown not to change the numbers.

Writes benchmarks/results/lr_parity.md, .png (curves per variant and world size) and .json (raw
numbers); the run directories (metrics.jsonl, steps.jsonl per run) stay under --scratch, and a run
whose directory is complete for the same arguments is reused (--fresh reruns everything).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
VARIANTS = {  # name -> (lr_scaling, uses warmup)
    "linear+warmup": ("linear", True),
    "linear, no warmup": ("linear", False),
    "no scaling": ("none", False),
}
BASELINE = "1 replica (base)"
SLUGS = {BASELINE: "base", "linear+warmup": "warmup", "linear, no warmup": "nowarmup", "no scaling": "noscale"}
TASKS = {
    "digits": {
        "config": "examples/digits/torch.yaml",
        "title": "digits (8x8, 1437 train / 359 val, MLP 64, SGD lr 0.05 m 0.9)",
    },
    "teacher": {
        "config": "benchmarks/lr_parity.yaml",
        "title": "teacher (synthetic, 8-dim, 10 classes, MLP 2x128, SGD lr 0.02 m 0.9)",
    },
}
STEPLOG = "[{class_path: benchmarks.lr_parity_task.StepLog}]"


# ---- the runs ------------------------------------------------------------------------------
def stress_variants(args: argparse.Namespace) -> list[str]:
    f, long = args.stress_factor, args.stress_long_warmup
    if not f:
        return []
    return [f"stress x{f}: linear+warmup", f"stress x{f}: linear, no warmup"] + (
        [f"stress x{f}: linear+warmup {long:g} epochs"] if long else []
    )


def variants_for(n: int, args: argparse.Namespace) -> list[str]:
    """Variants run at world size n: the baseline at 1; the chosen ones, and the stress pair at the largest n."""
    if n == 1:
        return [BASELINE]
    return list(args.variants) + (stress_variants(args) if n == max(args.replicas) else [])


def variant_spec(variant: str, n: int, args: argparse.Namespace) -> tuple[str, float, list[str], str]:
    """(lr_scaling, warmup epochs, extra trainer flags, directory name) of one variant."""
    stress = stress_variants(args)
    if variant in stress:  # base_batch_size 32 N / f: linear scaling multiplies the lr by f, not N
        flags = ["--trainer.base_batch_size", str(32 * n // args.stress_factor)]
        f = args.stress_factor
        if variant == stress[0]:
            return "linear", args.warmup_epochs, flags, f"stress{f}_warmup"
        if variant == stress[1]:
            return "linear", 0, flags, f"stress{f}_nowarmup"
        return "linear", float(args.stress_long_warmup), flags, f"stress{f}_warmup{args.stress_long_warmup:g}ep"
    scaling, warm = ("linear", True) if variant == BASELINE else VARIANTS[variant]
    return scaling, (args.warmup_epochs if warm else 0), [], SLUGS[variant]


def plan_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    for task in args.tasks:
        epochs = args.digits_epochs if task == "digits" else args.teacher_epochs
        extra = [] if task == "digits" else ["--data.init_args.n_train", str(args.teacher_train)]
        for n in args.replicas:
            for variant in variants_for(n, args):
                scaling, warmup, flags, slug = variant_spec(variant, n, args)
                for seed in range(args.seeds):
                    root = Path(args.scratch) / task / f"n{n}" / slug / f"seed{seed}"
                    fit_args = [
                        "-c",
                        TASKS[task]["config"],
                        *extra,
                        "--trainer.strategy",
                        "ddp",
                        "--trainer.root_dir",
                        str(root),
                        "--trainer.seed",
                        str(seed),
                        "--trainer.max_epochs",
                        str(epochs),
                        "--trainer.batch_size",
                        "32",
                        "--trainer.lr_scaling",
                        scaling,
                        "--trainer.warmup_epochs",
                        str(warmup),
                        "--trainer.progress_bar",
                        "false",
                        "--trainer.checkpoint",
                        "{enabled: false}",
                        "--trainer.tensorboard",
                        "{enabled: false}",
                        "--trainer.callbacks",
                        STEPLOG,
                        *flags,
                    ]
                    runs.append(
                        {
                            "id": f"{task} n{n} {slug} seed{seed}",
                            "task": task,
                            "replicas": n,
                            "variant": variant,
                            "seed": seed,
                            "epochs": epochs,
                            "root": str(root),
                            "fit_args": fit_args,
                        }
                    )
    return runs


def complete(run: dict[str, Any], root: str | None = None, fit_args: list[str] | None = None) -> bool:
    root_dir = Path(root or run["root"])
    try:
        same = json.loads((root_dir / "study_args.json").read_text()) == (fit_args or run["fit_args"])
        lines = (root_dir / "metrics.jsonl").read_text().splitlines()
        return same and len(lines) == run["epochs"] and (root_dir / "steps.jsonl").exists()
    except (OSError, ValueError):
        return False


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3"}


def run_grouped(runs: list[dict[str, Any]], n: int, args: argparse.Namespace) -> float:
    """One torchrun launch of n processes that runs every run in `runs`; returns its wall seconds."""
    scratch = Path(args.scratch)
    plan = scratch / f"plan_n{n}.json"
    plan.write_text(json.dumps([{"id": r["id"], "fit_args": r["fit_args"]} for r in runs]))
    for run in runs:
        shutil.rmtree(run["root"], ignore_errors=True)
    cmd = [
        "nice",
        "-n",
        str(args.nice),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        str(Path(__file__).resolve()),
        "--worker",
        str(plan),
    ]
    log = scratch / f"launch_n{n}.log"
    start, load = time.perf_counter(), os.getloadavg()[0]
    with open(log, "w") as out:
        code = subprocess.call(cmd, cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"launch of {n} processes failed (exit {code}); see {log}:\n{log.read_text()[-3000:]}")
    wall = time.perf_counter() - start
    for run in runs:
        (Path(run["root"]) / "study_args.json").write_text(json.dumps(run["fit_args"]))
        (Path(run["root"]) / "wall.json").write_text(
            json.dumps(
                {
                    "wall_s": wall / len(runs),
                    "launch_wall_s": wall,
                    "runs_in_launch": len(runs),
                    "load_1min_at_start": load,
                }
            )
        )
    return wall


def run_launch(run: dict[str, Any], args: argparse.Namespace, root: str | None = None) -> float:
    """One `unifit launch` (the per-run way); returns its wall seconds."""
    fit_args = list(run["fit_args"])
    if root is not None:
        fit_args[fit_args.index("--trainer.root_dir") + 1] = root
    target = Path(root or run["root"])
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    cmd = [
        "nice",
        "-n",
        str(args.nice),
        sys.executable,
        "-m",
        "unifit",
        "launch",
        "--nproc-per-node",
        str(run["replicas"]),
        *fit_args,
    ]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True)
    (target / "launch.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"{run['id']}: unifit launch failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    wall = time.perf_counter() - start
    (target / "study_args.json").write_text(json.dumps(fit_args))
    (target / "wall.json").write_text(json.dumps({"wall_s": wall, "launch_wall_s": wall, "runs_in_launch": 1}))
    return wall


def worker(plan_path: str) -> None:
    """Inside one torchrun rank: open the gloo group once, then `unifit fit` every planned run."""
    import torch.distributed as dist

    from unifit.cli import main as cli

    plan = json.loads(Path(plan_path).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    for i, run in enumerate(plan):
        start = time.perf_counter()
        code = cli.main(["fit", *run["fit_args"]])
        if code != 0:
            raise SystemExit(code)
        if rank == 0:
            print(f"[lr_parity] {i + 1}/{len(plan)} {run['id']}: {time.perf_counter() - start:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ---- reading the runs ------------------------------------------------------------------------
def read_run(run: dict[str, Any], root: str | None = None) -> dict[str, Any]:
    root_dir = Path(root or run["root"])
    epochs = [json.loads(line) for line in (root_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = json.loads((root_dir / "steps.jsonl").read_text()) if (root_dir / "steps.jsonl").exists() else None
    return {"epochs": epochs, "steps": steps}


def early_curve(steps: dict[str, Any], horizon: float, bins_per_epoch: int) -> dict[str, list[float]]:
    """Rank 0's step losses and lrs over the first `horizon` epochs, averaged in bins of 1/bins_per_epoch epoch."""
    spe = steps["steps_per_epoch"]
    sums: dict[int, list[float]] = {}
    for k, (loss, lr) in enumerate(steps["loss_lr"]):
        x = (k + 0.5) / spe  # the step's midpoint, in epochs
        if x >= horizon:
            break
        b = int(x * bins_per_epoch)
        acc = sums.setdefault(b, [0.0, 0.0, 0.0])
        acc[0] += loss
        acc[1] += lr
        acc[2] += 1
    keys = sorted(sums)
    return {
        "x": [(b + 0.5) / bins_per_epoch for b in keys],
        "loss": [sums[b][0] / sums[b][2] for b in keys],
        "lr": [sums[b][1] / sums[b][2] for b in keys],
    }


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(records: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for task in args.tasks:
        base = [r for r in records if r["task"] == task and r["replicas"] == 1]
        base_final = statistics.fmean(r["final_acc"] for r in base) if base else float("nan")
        target = base_final - 0.01
        for n in args.replicas:
            for variant in variants_for(n, args):
                group = [r for r in records if r["task"] == task and r["replicas"] == n and r["variant"] == variant]
                if not group:
                    continue
                reach = [next((e["epoch"] for e in r["epochs"] if e.get("val/acc", -1) >= target), None) for r in group]
                reached = [x for x in reach if x is not None]
                diffs = [r["final_acc"] - base_final for r in group]
                rows.append(
                    {
                        "task": task,
                        "replicas": n,
                        "variant": variant,
                        "seeds": len(group),
                        "global_batch": group[0]["global_batch"],
                        "peak_lr": max(r["peak_lr"] for r in group),
                        "first_lr": group[0]["first_lr"],
                        "epochs": group[0]["epochs"][-1]["epoch"],
                        "final_acc": mean_sd([r["final_acc"] for r in group]),
                        "best_acc": mean_sd([r["best_acc"] for r in group]),
                        "delta_final_pts": 100 * statistics.fmean(diffs),
                        "epoch1_loss": mean_sd([r["epochs"][0]["train/loss"] for r in group]),
                        "early_losses": [
                            statistics.fmean(r["epochs"][k]["train/loss"] for r in group)
                            for k in range(min(3, min(len(r["epochs"]) for r in group)))
                        ],
                        "final_accs": [r["final_acc"] for r in group],
                        "early_step_loss": mean_sd([r["early_loss"] for r in group]),
                        "final_val_loss": mean_sd([r["epochs"][-1]["val/loss"] for r in group]),
                        "epochs_to_target": statistics.fmean(reached) if reached else None,
                        "reached": len(reached),
                        "target": target,
                    }
                )
    return rows


def record_of(run: dict[str, Any], data: dict[str, Any], wall: float | None) -> dict[str, Any]:
    epochs, steps = data["epochs"], data["steps"]
    lrs = [lr for _, lr in steps["loss_lr"]] if steps else []
    spe = steps["steps_per_epoch"] if steps else 1
    quarter = [loss for loss, _ in steps["loss_lr"][: max(1, spe // 4)]] if steps else []
    return {
        "task": run["task"],
        "replicas": run["replicas"],
        "variant": run["variant"],
        "seed": run["seed"],
        "global_batch": steps["global_batch"] if steps else 32 * run["replicas"],
        "steps_per_epoch": spe,
        "first_lr": lrs[0] if lrs else None,
        "peak_lr": max(lrs) if lrs else epochs[-1]["lr"],
        "final_acc": epochs[-1]["val/acc"],
        "best_acc": max(e["val/acc"] for e in epochs),
        "early_loss": statistics.fmean(quarter) if quarter else float("nan"),  # rank 0, first quarter epoch
        "epochs": [
            {
                k: v
                for k, v in e.items()
                if k in ("epoch", "step", "elapsed_s", "lr", "train/loss", "train/acc", "val/loss", "val/acc")
            }
            for e in epochs
        ],
        "wall_s": wall,
    }


# ---- writing the results -----------------------------------------------------------------------
def fmt_pct(ms: tuple[float, float]) -> str:
    return f"{100 * ms[0]:.2f} ± {100 * ms[1]:.2f}"


def verdicts(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    out = []
    get = {(r["task"], r["replicas"], r["variant"]): r for r in rows}
    for task in args.tasks:
        base = get.get((task, 1, BASELINE))
        if base is None:
            continue
        for n in [n for n in args.replicas if n > 1]:
            w, nw, ns = (get.get((task, n, v)) for v in VARIANTS)
            parts = []
            if w:
                d = w["delta_final_pts"]
                parts.append(
                    f"linear+warmup final {d:+.2f} pts vs 1 replica ({'within' if abs(d) <= 1 else 'NOT within'} 1 pt)"
                )
            if w and nw:
                worse = nw["epoch1_loss"][0] > w["epoch1_loss"][0]
                peak = max(nw["early_losses"]) > max(w["early_losses"])
                parts.append(
                    f"no warmup epoch-1 train loss {nw['epoch1_loss'][0]:.3f} vs {w['epoch1_loss'][0]:.3f} with warmup "
                    f"({'worse' if worse else 'NOT worse'}; highest of epochs 1-3 {'higher' if peak else 'NOT higher'}), "
                    f"first-quarter-epoch step loss {nw['early_step_loss'][0]:.3f} vs {w['early_step_loss'][0]:.3f}; "
                    f"final {nw['delta_final_pts']:+.2f} pts"
                )
            if w and ns:
                later = (ns["epochs_to_target"] is None and w["epochs_to_target"] is not None) or (
                    None not in (ns["epochs_to_target"], w["epochs_to_target"])
                    and ns["epochs_to_target"] > w["epochs_to_target"]
                )
                lower = ns["final_acc"][0] < w["final_acc"][0] - 5e-4  # equal within float noise is not lower
                slower = {
                    (True, True): "slower: later to the target and lower at the end",
                    (True, False): "slower to the target, but NOT lower at the end",
                    (False, True): "NOT later to the target, but lower at the end",
                    (False, False): "NOT slower",
                }[later, lower]
                reach = (
                    "never (in any seed)"
                    if ns["epochs_to_target"] is None
                    else f"{ns['epochs_to_target']:.1f} epochs ({ns['reached']}/{ns['seeds']} seeds)"
                )
                reach_w = (
                    "never"
                    if w["epochs_to_target"] is None
                    else f"{w['epochs_to_target']:.1f} ({w['reached']}/{w['seeds']} seeds)"
                )
                parts.append(
                    f"no scaling final {ns['delta_final_pts']:+.2f} pts, reaches 1-replica final - 1 pt in {reach} "
                    f"vs {reach_w} with linear+warmup ({slower})"
                )
            out.append(f"- **{task}, {n} replicas**: " + "; ".join(parts) + ".")
        stress = [get.get((task, max(args.replicas), v)) for v in stress_variants(args)]
        if stress and all(stress):
            parts = [
                f"{r['variant'].split(': ', 1)[1]}: final {r['delta_final_pts']:+.2f} pts (seeds: "
                + ", ".join(f"{100 * a:.1f}" for a in r["final_accs"])
                + "), train loss epochs 1/2/3 "
                + " / ".join(f"{v:.2f}" for v in r["early_losses"])
                for r in stress
            ]
            out.append(
                f"- **{task}, {max(args.replicas)} replicas, lr x{args.stress_factor} (stress, peak lr "
                f"{stress[0]['peak_lr']:.3g})**: " + "; ".join(parts) + "."
            )
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def write_markdown(rows: list[dict[str, Any]], meta: dict[str, Any], args: argparse.Namespace, path: Path) -> str:
    table = [
        "| task | replicas | global batch | variant | peak lr | seeds | final val acc % (mean ± sd) | Δ final vs 1 replica (pts) "
        "| best val acc % (mean ± sd) | epoch-1 train loss (mean ± sd) | train loss epochs 1 / 2 / 3 | epochs to 1-replica final − 1 pt | epochs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reach = "never" if r["epochs_to_target"] is None else f"{r['epochs_to_target']:.1f}"
        if r["epochs_to_target"] is not None and r["reached"] < r["seeds"]:
            reach += f" ({r['reached']}/{r['seeds']} seeds)"
        table.append(
            f"| {r['task']} | {r['replicas']} | {r['global_batch']} | {r['variant']} | {r['peak_lr']:.3g} | {r['seeds']} "
            f"| {fmt_pct(r['final_acc'])} | {r['delta_final_pts']:+.2f} | {fmt_pct(r['best_acc'])} "
            f"| {r['epoch1_loss'][0]:.3f} ± {r['epoch1_loss'][1]:.3f} | {' / '.join(f'{v:.2f}' for v in r['early_losses'])} "
            f"| {reach} | {r['epochs']} |"
        )
    verify = meta.get("verify") or []
    verify_lines = [
        f"- `{v['id']}` through `unifit launch` ({v['wall_s']:.0f} s): largest per-epoch difference from the grouped "
        f"run: val/acc {v['max_abs_diff']['val/acc']:.2g}, val/loss {v['max_abs_diff']['val/loss']:.2g}, "
        f"train/loss {v['max_abs_diff']['train/loss']:.2g}"
        for v in verify
    ]
    text = "\n".join(
        [
            "# LR-scaling parity: N replicas at N x the batch vs 1 replica (Goyal et al. 2017)",
            "",
            f"Command: `{meta['command']}`",
            f"Machine: {meta['machine']}; shared with other jobs (1-minute load average "
            + (
                f"{min(meta['launch_loads']):.1f} to {max(meta['launch_loads']):.1f} when the launches started"
                if meta["launch_loads"]
                else f"{meta['load_start']} at the start, {meta['load_end']} at the end"
            )
            + f"), every process under `nice -n {args.nice}` with 1 torch thread; "
            f"date {meta['date']}; study wall time {meta['study_wall_s'] / 60:.1f} min (the launches that produced these runs, "
            f"plus the verification{'; this invocation reused ' + str(meta['reused_runs']) + ' complete runs and took ' + format(meta['wall_s'] / 60, '.1f') + ' min' if meta['reused_runs'] else ''}).",
            "",
            "Setup: ddp over gloo on CPU, one process per replica, batch 32 per replica (global batch 32 x N), same number "
            "of epochs at every world size (so N replicas take N times fewer optimizer steps). `1 replica (base)`: the base lr "
            "(digits 0.05, teacher 0.02; SGD, momentum 0.9). `linear+warmup`: `lr_scaling: linear` (lr x N) with "
            f"`warmup_epochs: {args.warmup_epochs:g}` (the lr ramps from the base to the scaled rate over the first "
            f"{args.warmup_epochs:g} epoch(s), per optimizer step); `linear, no warmup`: the scaled lr from step 0; `no scaling`: "
            "`lr_scaling: none` (the base lr at every world size). "
            + (
                f"`stress x{args.stress_factor}` (only at {max(args.replicas)} replicas; `--stress-factor`, 0 turns it off): "
                f"`base_batch_size: {32 * max(args.replicas) // args.stress_factor}`, so linear scaling multiplies the lr by "
                f"{args.stress_factor} instead of {max(args.replicas)} (digits {0.05 * args.stress_factor:g}, teacher "
                f"{0.02 * args.stress_factor:g}), with the same warmup, without warmup"
                + (f", and with a {args.stress_long_warmup:g}-epoch warmup" if args.stress_long_warmup else "")
                + ": a scaled lr far above the base one, the regime in which Goyal et al. needed warmup. "
                if args.stress_factor
                else ""
            )
            + "Seeds 0.."
            f"{args.seeds - 1} (`trainer.seed`: initial weights and data order; the data and the train/validation split are fixed). "
            f"Tasks: {TASKS['digits']['title']}, {args.digits_epochs} epochs; {TASKS['teacher']['title']}, "
            f"{args.teacher_train} train / 4096 val samples, {args.teacher_epochs} epochs. "
            "Accuracy is on the validation split after every epoch (averaged over ranks by samples); "
            "`epochs to 1-replica final − 1 pt` is the first epoch whose val acc reaches the 1-replica mean final accuracy "
            "minus 1 point (mean over the seeds that reach it); `epoch-1 train loss` is the mean training loss over the first "
            "epoch (all ranks).",
            "",
            f"Scaled down to fit ~35 minutes on this busy 2-core machine: {args.seeds} seeds, {args.digits_epochs} / "
            f"{args.teacher_epochs} epochs, {args.teacher_train} teacher training samples. Bigger: "
            "`--seeds 5 --teacher-epochs 30 --teacher-train 32768 --digits-epochs 20` (and `--replicas 1 2 4 8 16`).",
            "",
            *table,
            "",
            "Against the expectations (means over seeds; differences smaller than about one sd of the runs are noise: "
            "one digits validation sample is 0.28 pts):",
            "",
            *verdicts(rows, args),
            "",
            "Runs launched by `--launch "
            + args.launch
            + "`"
            + (
                ": one torchrun launch per world size (what `unifit launch` hands ddp to) whose ranks run every run of that "
                "world size one after the other through `unifit fit`'s own entry point, in a gloo group the worker opened "
                "(starting about 500 separate torch processes would cost more than the training on 2 cores). Checked against "
                "separate `unifit launch` runs of the same configuration:"
                if args.launch == "grouped"
                else ": every run is its own `python -m unifit launch --nproc-per-node N`."
            ),
            *verify_lines,
            "",
            "![loss and accuracy curves per variant and world size](lr_parity.png)",
            "",
            "Curves (`lr_parity.png`): mean over seeds (band: ± sd); columns are the variants, the 1-replica baseline (black) "
            "is drawn in every column. Rows per task: training loss per epoch, validation accuracy per epoch, and the first "
            "epochs step by step (rank 0's own loss on its batch of 32, binned, with the lr that the steps used, dashed, "
            "right axis). Raw numbers: `lr_parity.json`; run directories: `"
            + str(args.scratch)
            + "/<task>/n<N>/<variant>/seed<S>/` "
            "(metrics.jsonl, steps.jsonl, config.yaml).",
            "",
        ]
    )
    path.write_text(text)
    return text


def plot(records: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    stress = stress_variants(args)
    variants = list(args.variants) + stress
    colors = {1: "black", 2: "tab:blue", 4: "tab:orange", 8: "tab:red", 16: "tab:purple"}
    kinds = [
        ("train/loss", "train loss (epoch mean)"),
        ("val/acc", "val accuracy"),
        ("early", "step loss, first epochs"),
    ]
    fig, axes = plt.subplots(
        len(args.tasks) * len(kinds),
        len(variants),
        figsize=(4.6 * len(variants), 3.6 * len(args.tasks) * len(kinds)),
        squeeze=False,
    )
    for t, task in enumerate(args.tasks):
        task_records = [r for r in records if r["task"] == task]
        for k, (key, label) in enumerate(kinds):
            row = t * len(kinds) + k
            for c, variant in enumerate(variants):
                ax = axes[row][c]
                lr_ax = ax.twinx() if key == "early" else None
                for n in args.replicas:
                    group = [
                        r
                        for r in task_records
                        if r["replicas"] == n and r["variant"] == (BASELINE if n == 1 else variant)
                    ]
                    if not group:
                        continue
                    name = f"{n} replica{'s' if n > 1 else ''} (batch {32 * n})"
                    if key == "early":
                        curves = [r["early_curve"] for r in group if r.get("early_curve")]
                        if not curves:
                            continue
                        size = min(len(cv["x"]) for cv in curves)
                        x = np.array(curves[0]["x"][:size])
                        loss = np.array([cv["loss"][:size] for cv in curves])
                        lr = np.array([cv["lr"][:size] for cv in curves]).mean(0)
                        ax.plot(x, loss.mean(0), color=colors.get(n), label=name)
                        lr_ax.plot(x, lr, color=colors.get(n), linestyle="--", linewidth=1)
                    else:
                        size = min(len(r["epochs"]) for r in group)
                        x = np.array([e["epoch"] for e in group[0]["epochs"][:size]])
                        y = np.array([[e[key] for e in r["epochs"][:size]] for r in group])
                        if key == "val/acc":
                            y = 100 * y
                        mean, sd = y.mean(0), y.std(0, ddof=1) if len(group) > 1 else np.zeros(size)
                        ax.plot(x, mean, color=colors.get(n), label=name, marker=".", markersize=4)
                        ax.fill_between(x, mean - sd, mean + sd, color=colors.get(n), alpha=0.15, linewidth=0)
                if key == "train/loss":
                    ax.set_yscale("log")
                if key == "val/acc" and variant not in stress:
                    lows = [
                        100 * e["val/acc"] for r in task_records if r["variant"] not in stress for e in r["epochs"][1:]
                    ]
                    if lows:
                        ax.set_ylim(max(0, np.percentile(lows, 2) - 2), min(100, max(lows) + 1))
                if lr_ax is not None:
                    lrs = [v for r in task_records if r.get("early_curve") for v in r["early_curve"]["lr"]]
                    lr_ax.set_yscale("log")
                    lr_ax.set_ylim(min(lrs) / 1.25, max(lrs) * 1.25)
                    lr_ax.set_ylabel("lr (dashed)")
                ax.set_xlabel("epoch")
                ax.set_ylabel(label)
                ax.set_title(f"{task}: {variant}", fontsize=9)
                ax.grid(alpha=0.3)
                if c == 0 and k == 1:
                    ax.legend(fontsize=8, loc="lower right")
        # one y range per row (the stress columns keep their own), so the variants compare at a glance
        for k in range(len(kinds)):
            row_axes = [ax for c, ax in enumerate(axes[t * len(kinds) + k]) if variants[c] not in stress]
            lows, highs = zip(*(ax.get_ylim() for ax in row_axes))
            for ax in row_axes:
                ax.set_ylim(min(lows), max(highs))
    fig.suptitle(
        f"LR-scaling parity: mean of {args.seeds} seeds (band ± sd); black = 1 replica at batch 32"
        + (f"; stress columns: {max(args.replicas)} replicas with the lr x{args.stress_factor}" if stress else ""),
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---- driver --------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--replicas", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--digits-epochs", type=int, default=10)
    parser.add_argument("--teacher-epochs", type=int, default=15)
    parser.add_argument("--teacher-train", type=int, default=8192, help="training samples of the teacher task")
    parser.add_argument("--warmup-epochs", type=float, default=1.0)
    parser.add_argument(
        "--stress-factor",
        type=int,
        default=32,
        help="also run the largest world size with base_batch_size 32 N / F, i.e. lr x F, with and without "
        "warmup (0: off)",
    )
    parser.add_argument(
        "--stress-long-warmup",
        type=float,
        default=5.0,
        help="also run the stress factor with this many warmup epochs (0: off)",
    )
    parser.add_argument("--launch", choices=["grouped", "per-run"], default="grouped")
    parser.add_argument("--verify", type=int, default=1, help="grouped runs rerun through unifit launch and compared")
    parser.add_argument("--nice", type=int, default=19)
    parser.add_argument("--scratch", default="runs/lr_parity", help="run directories (relative to the repository)")
    parser.add_argument(
        "--out", default=str(RESULTS / "lr_parity"), help="results path without suffix (.md, .png, .json)"
    )
    parser.add_argument("--fresh", action="store_true", help="rerun runs whose directories are already complete")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if 1 not in args.replicas:
        raise SystemExit("--replicas must include 1 (the baseline)")
    if args.stress_factor and (32 * max(args.replicas)) % args.stress_factor:
        raise SystemExit(
            f"--stress-factor {args.stress_factor} must divide 32 x {max(args.replicas)} (the largest global batch)"
        )
    os.chdir(REPO)
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    started, load_start = time.perf_counter(), "/".join(f"{x:.1f}" for x in os.getloadavg())
    runs = plan_runs(args)
    walls: dict[str, float] = {}
    for n in args.replicas:
        todo = [r for r in runs if r["replicas"] == n and (args.fresh or not complete(r))]
        print(
            f"{n} replica(s): {len(todo)} runs to do, {sum(r['replicas'] == n for r in runs) - len(todo)} reused",
            flush=True,
        )
        if not todo:
            continue
        if args.launch == "grouped":
            wall = run_grouped(todo, n, args)
            for r in todo:
                walls[r["id"]] = wall / len(todo)
        else:
            for r in todo:
                walls[r["id"]] = run_launch(r, args)
        print(f"  done in {time.perf_counter() - started:.0f} s", flush=True)

    records = []
    for run in runs:
        data = read_run(run)
        wall_file = Path(run["root"]) / "wall.json"
        rec = record_of(run, data, json.loads(wall_file.read_text())["wall_s"] if wall_file.exists() else None)
        if data["steps"]:
            rec["_steps"] = data["steps"]  # binned below, once every run's steps per epoch are known
        records.append(rec)
    for task in args.tasks:
        group = [r for r in records if r["task"] == task]
        bins = max(1, min(16, min(r["steps_per_epoch"] for r in group)))
        for r in group:
            if r.get("_steps"):
                r["early_curve"] = early_curve(r.pop("_steps"), max(2.0, 2 * args.warmup_epochs), bins)

    verify = []
    if args.launch == "grouped" and args.verify > 0:
        picks = [
            r
            for r in runs
            if r["replicas"] == max(args.replicas) and r["variant"] == "linear+warmup" and r["seed"] == 0
        ]
        picks += [r for r in runs if r["replicas"] > 1 and r not in picks and r["seed"] == 0]
        for run in picks[: args.verify]:
            root = str(Path(args.scratch) / "verify" / run["id"].replace(" ", "_"))
            fit_args = list(run["fit_args"])
            fit_args[fit_args.index("--trainer.root_dir") + 1] = root
            if args.fresh or not complete(run, root, fit_args):
                run_launch(run, args, root=root)
            wall = json.loads((Path(root) / "wall.json").read_text())["wall_s"]
            a, b = read_run(run)["epochs"], read_run(run, root)["epochs"]
            diff = {k: max(abs(x[k] - y[k]) for x, y in zip(a, b)) for k in ("val/acc", "val/loss", "train/loss")}
            verify.append(
                {"id": run["id"], "wall_s": wall, "max_abs_diff": diff, "epochs_compared": min(len(a), len(b))}
            )
            print(f"verify {run['id']}: {diff}", flush=True)

    rows = summarize(records, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    default_cmd = ".venv/bin/python benchmarks/lr_parity.py"
    given = " ".join(sys.argv[1:])
    meta = {
        "command": f"{default_cmd} {given}".strip(),
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "load_start": load_start,
        "load_end": "/".join(f"{x:.1f}" for x in os.getloadavg()),
        "wall_s": time.perf_counter() - started,
        "verify": verify,
        "study_wall_s": sum(r["wall_s"] or 0 for r in records) + sum(v["wall_s"] for v in verify),
        "reused_runs": len(runs) - len(walls),
        "launch_loads": sorted(
            {
                json.loads((Path(r["root"]) / "wall.json").read_text()).get("load_1min_at_start")
                for r in runs
                if (Path(r["root"]) / "wall.json").exists()
            }
            - {None}
        ),
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
    }
    plot(records, args, out.with_suffix(".png"))
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": records}, indent=1))
    text = write_markdown(rows, meta, args, out.with_suffix(".md"))
    print(text)


if __name__ == "__main__":
    main()
