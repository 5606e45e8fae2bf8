"""The redesign's seams: a strategy of the user's own by class path owns the step and state IO,
the typed Progress moves with the loop and is saved, and imports run one way (no cycle)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, assert_ok, probe_args, reports, run_unifit

CUSTOM = "tests.probe.custom_strategy:CountingDDP"


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_strategy_by_class_path_owns_step_clip_and_state_io(tmp_path):
    out = tmp_path / "counts"
    out.mkdir()
    env = {"COUNTING_STRATEGY_OUT": str(out)}
    # 64 samples / 2 ranks / batch 8 = 4 micro-batches per epoch, 2 per optimizer step
    args = ["--trainer.accumulate_grad_batches", "2", "--trainer.gradient_clip_val", "1.0", "--trainer.max_epochs", "2"]
    first = run_unifit(*_custom(probe_args("ddp", tmp_path / "run", *args)), env=env, timeout=240)
    assert_ok(first)
    counts = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for c in counts:
        assert c == {"backward": 8, "optimizer_step": 4, "clip": 4, "save": 2, "load": 0, "accumulating": 4}, counts
    final = reports(tmp_path / "run")
    assert len(final) == 2 and len({r["weights_sha256"] for r in final}) == 1  # the user's DDP still averages

    resumed = run_unifit(
        *_custom(probe_args("ddp", tmp_path / "run", "--trainer.max_epochs", "3", *args[:4], ckpt="last")),
        env=env,
        timeout=240,
    )
    assert_ok(resumed)
    assert json.loads((out / "rank0.json").read_text())["load"] == 1


def _custom(args: list[str]) -> list[str]:
    i = args.index("--trainer.strategy")
    return args[: i + 1] + [CUSTOM] + args[i + 2 :]


@pytest.mark.parametrize(
    "path, expected",
    [
        ("tests.probe.custom_strategy:NotAStrategy", "not a subclass of unifit.strategies.Strategy"),
        ("tests.probe.nowhere:Thing", "tests.probe.nowhere"),
        ("ddpp", "unknown strategy 'ddpp'"),
    ],
)
def test_bad_strategy_class_path_is_one_line(tmp_path, cli, path, expected):
    result = cli("print-config", "-c", str(REPO / "tests/probe/probe.yaml"), "--trainer.strategy", path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "trainer.strategy" in lines[0] and expected in lines[0], result.stderr


def test_progress_moves_with_the_loop_and_is_saved(tmp_path):
    import torch

    import unifit
    from tests.probe.probe import ProbeModule

    seen = []

    class Watch(unifit.Callback):
        def on_train_batch_end(self, ctx, loss, batch_idx):
            p = ctx.progress
            seen.append((p.epoch, p.batch_in_epoch, p.optimizer_step, p.samples_seen))

    trainer = unifit.Trainer(
        max_epochs=2,
        batch_size=8,
        accumulate_grad_batches=3,
        root_dir=str(tmp_path),
        progress_bar=False,
        callbacks=[Watch()],
    )
    state = trainer.fit(ProbeModule(n_train=60))
    # 60 samples / 8 = 8 micro-batches (the last has 4); optimizer steps after micro-batches 3, 6, 8
    assert seen[:8] == [(0, b, s, 0) for b, s in zip(range(1, 9), [0, 0, 1, 1, 1, 2, 2, 3])]
    assert seen[8] == (1, 1, 3, 60)
    p = state.progress
    assert (p.epoch, p.optimizer_step, p.samples_seen, p.batch_in_epoch) == (2, 6, 120, 0)
    assert (p.global_batch, p.batches_per_epoch, p.steps_per_epoch) == (24, 8, 3)
    saved = torch.load(tmp_path / "checkpoints" / "epoch=0002-step=0000006" / "state.pt", weights_only=True)
    assert saved["trainer"]["progress"]["samples_seen"] == 120

    resumed = unifit.Trainer(
        max_epochs=3, batch_size=8, accumulate_grad_batches=3, root_dir=str(tmp_path), progress_bar=False
    ).fit(ProbeModule(n_train=60), ckpt_path="last")
    assert (resumed.progress.epoch, resumed.progress.optimizer_step, resumed.progress.samples_seen) == (3, 9, 180)


def test_state_from_a_checkpoint_written_before_progress():
    from unifit.loop.state import TrainState

    old = {
        "epoch": 2,
        "global_step": 16,
        "batch_idx": 7,
        "steps_per_epoch": 8,
        "metrics": {"val/loss": 0.5},
        "should_stop": False,
        "stop_reason": None,
    }
    state = TrainState.from_dict(old)
    assert (state.epoch, state.global_step, state.progress.steps_per_epoch) == (2, 16, 8)
    assert state.metrics == {"val/loss": 0.5}


@pytest.mark.launch
def test_imports_run_one_way():
    """pyproject's import-linter layers contract holds, and it covers every module of unifit."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlinter.cli import lint_imports; raise SystemExit(lint_imports(no_cache=True))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "1 kept, 0 broken" in result.stdout

    import tomllib

    layers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    covered = {name.strip() for layer in layers for name in layer.split("|")}
    modules = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for p in (REPO / "unifit").rglob("*.py")
    }
    entry = {"unifit", "unifit.__main__", "unifit.trainer"}  # lazy re-exports and `python -m unifit`
    outside = sorted(m for m in modules - entry if not any(m == c or m.startswith(c + ".") for c in covered))
    assert not outside, f"modules in no layer of the import contract: {outside}"


class _RankView:
    """Strategy.load_checkpoint as rank 1 of 2 sees it (rank 0's side is the real code at world 1)."""

    def __init__(self, others_blind: bool):
        from unifit.strategies.base import Strategy
        from unifit.strategies.environment import ClusterEnvironment

        class Rank1(Strategy):
            name = "rank1"

            def rank_zero_call(self, fn):
                return "s3://bucket/ckpt/epoch=0001-step=0000004"  # what rank 0 found

            def all_reduce_max(self, values):
                return values if not others_blind else np.maximum(values, 1.0)

            def broadcast_object(self, obj, src=0):
                return {"from": "rank 0"}

        import numpy as np

        self.strategy = Rank1(ClusterEnvironment(rank=1, world_size=2))


@pytest.mark.parametrize(
    "readable, others_blind, expected",
    [
        (True, False, {"from": "rank 1's own read"}),  # shared storage: no weights over the wire
        (False, False, {"from": "rank 0"}),  # this rank cannot read it: rank 0 sends
        (True, True, {"from": "rank 0"}),  # another rank cannot: everyone takes rank 0's copy
    ],
)
def test_every_rank_reads_its_state_itself_where_it_can(readable, others_blind, expected):
    def read_at(url):
        assert url == "s3://bucket/ckpt/epoch=0001-step=0000004"
        if not readable:
            raise FileNotFoundError(url)
        return {"from": "rank 1's own read"}

    state, url = _RankView(others_blind).strategy.load_checkpoint(lambda: (None, None), read_at)
    assert state == expected and url.endswith("epoch=0001-step=0000004")


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_ranks_on_a_shared_directory_read_the_checkpoint_themselves(tmp_path):
    run = tmp_path / "run"
    assert_ok(run_unifit(*probe_args("ddp", run, "--trainer.max_epochs", "1")))
    resumed = run_unifit(*probe_args("ddp", run, "--trainer.max_epochs", "2", ckpt="last"))
    assert_ok(resumed)
    assert "every rank read" in resumed.stderr and "sends its copy" not in resumed.stderr
