"""Mixed precision on CPU (torch autocast + GradScaler): identical replicas, close to full precision,
exact resume, under real launchers. The GPU variants are in tests/gpu."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_ok, at_most, launch_probe, metrics_lines, reports, selected_params

pytestmark = pytest.mark.launch

# bf16-mixed where gradients are averaged differently (the Keras strategies are in test_precision_keras.py);
# 16-mixed: in DDP's backward hooks, or in Horovod's optimizer.synchronize(). single and smddp-like in
# bf16-mixed are in tests/test_zoo.py (single equals Lightning's Trainer bit for bit; smddp-like ddp's weights)
CASES = [("ddp", "bf16-mixed"), ("horovod", "bf16-mixed"), ("ddp", "16-mixed"), ("horovod", "16-mixed")]
# clipping and accumulation make the scaler's unscale/skip path and DDP's no_sync part of every case
STEP_OPTIONS = (
    "--trainer.gradient_clip_val",
    "0.5",
    "--trainer.accumulate_grad_batches",
    "2",
    "--module.init_args.dropout",
    "0.0",
)


def _part_then_resumed(strategy: str, precision: str, part: Path) -> None:
    """2 epochs, then resumed from the last checkpoint for 2 more."""
    common = (*STEP_OPTIONS, "--trainer.precision", precision)
    assert_ok(launch_probe(strategy, part, *common, "--trainer.max_epochs", "2"))
    assert_ok(launch_probe(strategy, part, *common, "--trainer.max_epochs", "4", ckpt="last"))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    """(strategy, precision) -> its roots (mixed, full, part), every selected case's launches made at the first
    test, two at a time (a case's mixed, full-precision and part-then-resumed runs are independent)."""
    cases = selected_params(request, "case")
    roots = {c: {k: tmp_path_factory.mktemp(f"{c[0]}-{c[1]}-{k}") for k in ("mixed", "full", "part")} for c in cases}
    jobs, owners = [], []
    for strategy, precision in cases:
        where = roots[(strategy, precision)]
        jobs.append(functools.partial(_run, strategy, where["mixed"], "--trainer.precision", precision))
        if precision == "bf16-mixed":  # its curve is compared with full precision's
            jobs.append(functools.partial(_run, strategy, where["full"]))
        jobs.append(functools.partial(_part_then_resumed, strategy, precision, where["part"]))
        owners += [(strategy, precision)] * (3 if precision == "bf16-mixed" else 2)
    failed = {owner: got for owner, got in zip(owners, at_most(2, jobs), strict=True) if isinstance(got, BaseException)}
    return {case: (roots[case], failed.get(case)) for case in cases}


def _run(strategy: str, root: Path, *extra: str) -> None:
    assert_ok(launch_probe(strategy, root, *STEP_OPTIONS, *extra, "--trainer.max_epochs", "4"))


@pytest.mark.timeout(900)  # the first test makes every case's runs, two at a time
@pytest.mark.parametrize("case", CASES, ids=[f"{s}-{p}" for s, p in CASES])
def test_mixed_precision_replicas_agree_track_full_precision_and_resume_exactly(runs, case):
    strategy, precision = case
    where, failed = runs[case]
    if failed is not None:
        raise failed
    full, mixed, part = where["full"], where["mixed"], where["part"]
    got = reports(mixed)
    assert len({r["weights_sha256"] for r in got}) == 1  # every rank holds the same weights
    assert all(r["metrics"] == got[0]["metrics"] for r in got)
    low = metrics_lines(mixed)
    if precision == "bf16-mixed":  # 8 bits of mantissa: the curve follows full precision loosely
        ref = metrics_lines(full)
        assert [m["train/loss"] for m in low] != [m["train/loss"] for m in ref]  # autocast really ran
        assert [m["val/loss"] for m in low] == pytest.approx([m["val/loss"] for m in ref], rel=0.15, abs=0.05)
    else:  # the GradScaler starts at 2**16 and skips the overflowing first steps, so float16 lags, but learns
        assert low[-1]["val/loss"] < low[0]["val/loss"] / 2
        name = json.loads((mixed / "checkpoints" / "last.json").read_text())["name"]
        state = torch.load(mixed / "checkpoints" / name / "state.pt", weights_only=True)
        assert 0 < state["engine"]["precision"]["scaler"]["scale"] < 2.0**16  # the scaler ran and backed off

    resumed = metrics_lines(part)
    assert [m["epoch"] for m in resumed] == [1, 2, 3, 4]
    assert [m["train/loss"] for m in resumed] == pytest.approx([m["train/loss"] for m in low], rel=1e-9)
    assert reports(part)[0]["weights_sha256"] == got[0]["weights_sha256"]


def test_fsdp_asks_the_precision_what_it_computes_in_never_its_name():
    """A precision fsdp has never heard of is taken by what it is: its dtype is what parameters are gathered in
    (param_dtype auto: on GPUs), and any precision that scales the loss is refused, by its own name."""
    from unifit.errors import ConfigError
    from unifit.strategies import registry
    from unifit.strategies.environment import ClusterEnvironment
    from unifit.strategies.fsdp import _refuse_float16
    from unifit.strategies.torch_precision import MixedPrecision, Precision

    class Half(Precision):
        name, dtype = "half-true", torch.float16

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for options, on_gpu, on_cpu in (({}, torch.float16, None), ({"param_dtype": "bfloat16"}, torch.float16, torch.float16)):  # fmt: skip
        fsdp = registry.create("fsdp", ClusterEnvironment(), framework="torch", options=options)
        fsdp.precision = Half()
        assert (fsdp._gather_dtype(cuda), fsdp._gather_dtype(cpu)) == (on_gpu, on_cpu)
        fsdp.precision = Precision()
        assert fsdp._gather_dtype(cuda) is None
    _refuse_float16(Half())  # no loss scaling: taken
    scaled = MixedPrecision("my-float16", torch.float16, cpu)
    with pytest.raises(ConfigError, match="received 'my-float16', which fsdp does not support"):
        _refuse_float16(scaled)
