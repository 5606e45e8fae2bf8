"""Keras mixed precision (trainer.precision) and XLA (trainer.compile) on CPU, under every Keras strategy.

For bf16-mixed under single, mirrored (2 logical CPUs), mwms (2 workers) and horovod (2 ranks): the
same weights on every replica and rank, the loss curve within a measured tolerance of 32-true, and
exact resume (a run resumed from its epoch-1 checkpoint ends where the uninterrupted run ends).
16-mixed: clipping at the loss scale, and a loss scale that backs off when one replica's gradients
overflow (that step is skipped on every replica), saved in the checkpoint and restored on resume.
compile: XLA tracks the uncompiled run; a step XLA cannot compile is refused in one line.

The single and mirrored fits run one after another in one child process (TensorFlow is imported
once, and a fit must not leave Keras' global dtype policy behind for the next), in the background
while the mwms and horovod runs are launched.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import KERAS_PROBE_YAML, REPO, assert_ok, launch_probe, metrics_lines, reports
from tests.probe.keras_probe import KerasProbe, indexed

pytestmark = [pytest.mark.launch, pytest.mark.tf]

# No dropout and no clipping: then every 2-replica strategy (mirrored, mwms, horovod) takes the same
# steps from the same initial weights, and mirrored's 32-true run is the reference for all three
# (dropout masks depend on which replica holds a sample; under tf.distribute gradient_clip_val clips
# each replica's share of the gradient, under horovod the averaged gradient).
COMMON = (
    "--module.class_path",
    "tests.test_precision_keras.PlainProbe",
    "--module.init_args.dropout",
    "0.0",
    "--trainer.max_epochs",
    "2",
)
# bf16-mixed vs 32-true, relative, per epoch, measured on these runs: at most 1.2% (mirrored, train
# loss of epoch 2), 0.94% (mwms, horovod), 0.72% (single); bfloat16 rounds each op's result to 8
# significant bits (2**-9 relative). 32-true itself differs by <= 7e-8 between mirrored, mwms and
# horovod. 5% is 4x the largest gap, and still fails on gradients or updates at the wrong scale.
BF16_REL = 0.05


class PlainProbe(KerasProbe):
    """The Keras probe without its tf.py_function recorder, so XLA can compile its step.
    Records the global dtype policy each model was built under (this process's fits)."""

    built_under: list[str] = []

    def _record(self, phase, x, training) -> None:
        pass

    def build_model(self):
        import keras

        PlainProbe.built_under.append(keras.config.dtype_policy().name)
        return super().build_model()


class OverflowProbe(PlainProbe):
    """One training target so large that its float16 gradient overflows at any loss scale above ~16.
    Under mirrored (seed 0) sample 17 is in step 2 of 4 of both epochs, on the second replica, whose
    gradients alone overflow: Keras' own LossScaleOptimizer reads the first replica's only."""

    def train_dataset(self):
        x, y = indexed(self.n_train, seed=1)
        y[17] = 3e4
        return x, y


# ---- the single and mirrored fits, in one child process ---------------------------------------
def _fits(root: Path) -> list[tuple[str, list[str]]]:
    """(name, command-line arguments) of every in-process fit, in order."""

    def fit(name: str, strategy: str, *extra: str, ckpt: str | None = None) -> tuple[str, list[str]]:
        report = {
            "class_path": "tests.probe.callbacks.ProbeReport",
            "init_args": {"out_dir": str(root / name / "reports")},
        }
        options = ["--trainer.strategy_options", "{devices: 2}"] if strategy == "mirrored" else []
        args = [
            "fit",
            "-c",
            str(KERAS_PROBE_YAML),
            "--trainer.strategy",
            strategy,
            "--trainer.root_dir",
            str(root / name),
            "--trainer.callbacks",
            json.dumps([report]),
            *options,
            *COMMON,
            *extra,
        ]
        return name, args + (["--ckpt-path", ckpt] if ckpt else [])

    def epoch_1(name: str, steps: int) -> str:
        return str(root / name / "checkpoints" / f"epoch=0001-step={steps:07d}")

    bf16, fp16, clip = (
        ("--trainer.precision", "bf16-mixed"),
        ("--trainer.precision", "16-mixed"),
        ("--trainer.gradient_clip_val", "0.5"),
    )
    overflow = ("--module.class_path", "tests.test_precision_keras.OverflowProbe", *fp16, *clip)
    return [  # mirrored first: it splits the CPU into 2 logical devices before TensorFlow starts
        fit("mirrored-bf16", "mirrored", *bf16),
        fit("mirrored-32", "mirrored"),  # right after a bf16 fit: its global policy must be gone
        fit("mirrored-bf16-resumed", "mirrored", *bf16, ckpt=epoch_1("mirrored-bf16", 4)),
        fit("mirrored-32-xla", "mirrored", "--trainer.compile", "true"),
        fit("mirrored-16-clip", "mirrored", *fp16, *clip),
        fit("mirrored-32-clip", "mirrored", *clip),
        fit("mirrored-16-overflow", "mirrored", *overflow),
        fit("mirrored-16-overflow-resumed", "mirrored", *overflow, ckpt=epoch_1("mirrored-16-overflow", 4)),
        fit("single-bf16", "single", *bf16),
        fit("single-32", "single"),
        fit("single-bf16-resumed", "single", *bf16, ckpt=epoch_1("single-bf16", 8)),
        fit(
            "single-xla-refused",
            "single",
            "--module.class_path",
            "tests.probe.keras_probe.KerasProbe",
            "--trainer.compile",
            "true",
        ),  # the probe's own step holds a tf.py_function
    ]


def run_fits(root: str) -> None:
    """The child process: every fit of _fits; exit codes, error lines and the global dtype policy
    after each go to results.json."""
    import keras

    from unifit.cli.main import main

    results = {}
    for name, args in _fits(Path(root)):
        err = io.StringIO()
        before = len(PlainProbe.built_under)
        with contextlib.redirect_stderr(err):
            code = main(args)
        results[name] = {
            "code": code,
            "errors": [line for line in err.getvalue().splitlines() if "error" in line],
            "traceback": "Traceback" in err.getvalue(),
            "policy_after": keras.config.dtype_policy().name,
            "built_under": PlainProbe.built_under[before:],
        }
        print(f"{name}: exit {code} {results[name]['errors']}", file=sys.__stderr__, flush=True)
    Path(root, "results.json").write_text(json.dumps(results))


class _Fits:
    """The child process running run_fits, started at once and waited for when a test needs it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        code = f"from tests.test_precision_keras import run_fits; run_fits({str(root)!r})"
        with open(root / "child.log", "w") as log:  # a file, not a pipe nobody drains while launches run
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._results: dict | None = None

    def results(self, timeout: float = 500) -> dict:
        if self._results is None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"the in-process fits took over {timeout}s")
            log = (self.root / "child.log").read_text()
            assert self.proc.returncode == 0, log[-4000:]
            self._results = json.loads((self.root / "results.json").read_text())
            failed = {k: v for k, v in self._results.items() if v["code"] != 0 and k != "single-xla-refused"}
            assert not failed, failed
        return self._results

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    fits = _Fits(tmp_path_factory.mktemp("keras-precision"))
    yield fits
    fits.kill()


def _losses(root: Path, key: str = "train/loss") -> list[float]:
    return [m[key] for m in metrics_lines(root)]


def _precision_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "state.json").read_text())["engine"]["precision"]


def _last(root: Path) -> Path:
    return root / "checkpoints" / json.loads((root / "checkpoints" / "last.json").read_text())["name"]


def _check_bf16(full: Path, resumed: Path, reference: Path) -> None:
    """Replicas and ranks agree, the curve tracks 32-true, and resuming from epoch 1 ends the same."""
    got = reports(full)
    assert got and all(r["replicas_identical"] for r in got)
    assert len({r["weights_sha256"] for r in got}) == 1
    assert _losses(full) != _losses(reference)  # bfloat16 really ran
    for key in ("train/loss", "val/loss"):
        assert _losses(full, key) == pytest.approx(_losses(reference, key), rel=BF16_REL), key
    again = metrics_lines(resumed)
    assert [m["epoch"] for m in again] == [2]
    for key in ("train/loss", "val/loss"):
        assert again[0][key] == metrics_lines(full)[-1][key], key  # exactly
    assert reports(resumed)[0]["weights_sha256"] == got[0]["weights_sha256"]


# ---- launched strategies (first: the in-process fits run meanwhile) ----------------------------
@pytest.mark.timeout(660)
@pytest.mark.parametrize("strategy", ["mwms", "horovod-keras"])
def test_bf16_launched_strategies(local, tmp_path, strategy):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert_ok(launch_probe(strategy, full, *COMMON, "--trainer.precision", "bf16-mixed", timeout=300))
    assert_ok(
        launch_probe(
            strategy,
            resumed,
            *COMMON,
            "--trainer.precision",
            "bf16-mixed",
            timeout=300,
            ckpt=str(full / "checkpoints" / "epoch=0001-step=0000004"),
        )
    )
    local.results()
    _check_bf16(full, resumed, local.root / "mirrored-32")


# ---- single and mirrored -------------------------------------------------------------------------
@pytest.mark.timeout(540)
@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_bf16_in_process_strategies(local, strategy):
    local.results()
    root = local.root
    _check_bf16(root / f"{strategy}-bf16", root / f"{strategy}-bf16-resumed", root / f"{strategy}-32")


@pytest.mark.timeout(540)
def test_a_fit_leaves_no_global_dtype_policy_behind(local):
    results = local.results()
    assert {r["policy_after"] for r in results.values()} == {"float32"}
    assert results["mirrored-bf16"]["built_under"] == ["mixed_bfloat16"]
    assert results["mirrored-32"]["built_under"] == ["float32"]  # the fit right after a bf16 fit
    assert results["mirrored-16-clip"]["built_under"] == ["mixed_float16"]


@pytest.mark.timeout(540)
def test_float16_clips_at_the_loss_scale_and_tracks_full_precision(local):
    """Gradients are clipped while still scaled, at clip x scale: the same step as 32-true's (clipping
    them at `clip` itself would shrink every step by the scale, 2**15, and the loss would not fall)."""
    local.results()
    fp16, fp32 = local.root / "mirrored-16-clip", local.root / "mirrored-32-clip"
    for key in ("train/loss", "val/loss"):
        assert _losses(fp16, key) == pytest.approx(_losses(fp32, key), rel=0.01), key
    assert _losses(fp16) != _losses(fp32)  # float16 really ran
    assert _precision_state(_last(fp16)) == {"loss_scale": 2.0**15, "good_steps": 8}  # nothing overflowed


@pytest.mark.timeout(540)
def test_float16_overflow_on_one_replica_skips_the_step_everywhere_and_the_scale_resumes(local):
    local.results()
    full, resumed = local.root / "mirrored-16-overflow", local.root / "mirrored-16-overflow-resumed"
    got = reports(full)
    assert got[0]["replicas_identical"]
    assert np.isfinite(got[0]["weights_sum"])  # the second replica's inf never reached the weights
    assert all(np.isfinite(_losses(full, "val/loss")))
    # one skipped step per epoch: the scale halves, and the 2 steps after it count towards growing it
    assert _precision_state(full / "checkpoints" / "epoch=0001-step=0000004") == {
        "loss_scale": 2.0**14,
        "good_steps": 2,
    }
    assert _precision_state(_last(full)) == {"loss_scale": 2.0**13, "good_steps": 2}
    assert _precision_state(_last(resumed)) == _precision_state(_last(full))  # it went on from 2**14
    assert _losses(resumed) == _losses(full)[1:]
    assert reports(resumed)[0]["weights_sha256"] == got[0]["weights_sha256"]


@pytest.mark.timeout(540)
def test_compile_runs_xla_and_tracks_the_uncompiled_run(local):
    results = local.results()
    xla, plain = local.root / "mirrored-32-xla", local.root / "mirrored-32"
    assert reports(xla)[0]["replicas_identical"]
    for key in ("train/loss", "val/loss"):
        assert _losses(xla, key) == pytest.approx(_losses(plain, key), rel=1e-5), key
    refused = results["single-xla-refused"]  # proves the step really went to XLA: py_function cannot
    assert refused["code"] == 2 and not refused["traceback"] and len(refused["errors"]) == 1, refused
    line = refused["errors"][0]
    assert line.startswith("unifit: error: trainer.compile: received true") and "EagerPyFunc" in line, line
    assert "set trainer.compile: false" in line, line
