"""strategy: fsdp on CPU (gloo), beyond the conformance suite it also passes: each rank holds 1/N of the
state, sharded checkpoints resume on another world size and under ddp (and ddp's under fsdp), the
clipped, accumulated, warmed-up step equals ddp's, the exported model is whole, and bad input is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_ok, launch_probe, metrics_lines, run_unifit

WIDE = ["--module.init_args.hidden", "256", "--module.init_args.dropout", "0.0"]
STEP_FEATURES = [
    "--trainer.accumulate_grad_batches",
    "2",
    "--trainer.gradient_clip_val",
    "0.05",
    "--trainer.warmup_epochs",
    "1",
]


def _shards(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("shards_*.json"))]


def _shard_report(out: Path) -> list[dict]:
    return [{"class_path": "tests.probe.probe.ShardReport", "init_args": {"out_dir": str(out)}}]


def _launch(strategy: str, root: Path, procs: int, *overrides: str, ckpt: str | None = None):
    result = launch_probe(
        strategy,
        root,
        "--nproc-per-node",
        str(procs),
        *WIDE,
        *overrides,
        ckpt=ckpt,
        callbacks=_shard_report(root / "shards"),
        timeout=240,
    )
    assert_ok(result)
    return result


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_each_rank_holds_a_quarter_of_the_state_and_the_export_is_whole(tmp_path):
    root = tmp_path / "run"
    _launch("fsdp", root, 4, "--trainer.max_epochs", "1", "--trainer.export_dir", str(tmp_path / "export"))
    shards = _shards(root / "shards")
    assert [s["rank"] for s in shards] == [0, 1, 2, 3]
    total = shards[0]["params_total"]
    assert total == 8 * 256 + 256 + 256 + 1  # the whole model's, as every rank sees it
    for kind in ("params", "optimizer"):
        local = [s[f"{kind}_local"] for s in shards]
        assert sum(local) == total, kind  # every element on exactly one rank
        assert max(local) <= total / 4 * 1.1, (kind, local)  # 1/N each (+ the uneven last shard)
    # the export: one whole state dict, loadable into the plain module, equal to the trained weights
    from tests.probe.probe import ProbeModule, _digest

    module = ProbeModule(hidden=256, dropout=0.0)
    module.load_state_dict(torch.load(tmp_path / "export" / "model.pt", weights_only=True))
    assert _digest(module) == shards[0]["end_sha256"]
    saved = next((root / "checkpoints").glob("epoch=*"))
    assert sorted(p.name for p in (saved / "shards").iterdir()) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]


@pytest.mark.launch
@pytest.mark.timeout(600)
def test_sharded_checkpoint_resumes_on_another_world_size_and_under_ddp_and_back(tmp_path):
    """2 fsdp ranks save; 4 fsdp ranks (DCP reshards) and 4 ddp ranks (read whole) resume it and
    must train on identically; a ddp checkpoint resumed by fsdp equals ddp resuming its own."""
    first = tmp_path / "fsdp2"
    _launch("fsdp", first, 2, "--trainer.max_epochs", "2")
    saved_sha = _shards(first / "shards")[0]["end_sha256"]
    runs = {}
    for name, strategy in (("fsdp4", "fsdp"), ("ddp4", "ddp")):
        shutil.copytree(first, tmp_path / name)
        result = _launch(strategy, tmp_path / name, 4, "--trainer.max_epochs", "4", ckpt="last")
        assert "resume: learning rates rescaled x2" in result.stderr  # linear scaling: 2 -> 4 ranks
        runs[name] = tmp_path / name
    for run in runs.values():
        assert {s["start_sha256"] for s in _shards(run / "shards")} == {saved_sha}  # weights as saved, whole
        assert [s["lr"] for s in _shards(run / "shards")] == pytest.approx([0.05 * 4] * 4)  # base lr x 4 ranks
    fsdp, ddp = metrics_lines(runs["fsdp4"]), metrics_lines(runs["ddp4"])
    assert [m["epoch"] for m in fsdp] == [1, 2, 3, 4]
    for key in ("train/loss", "val/loss"):  # momentum buffers resumed alike too, or the curves part
        assert [m[key] for m in fsdp[2:]] == pytest.approx([m[key] for m in ddp[2:]], rel=1e-5), key

    # and back: a ddp checkpoint (whole) resumed under fsdp, against ddp resuming it
    base = tmp_path / "ddp2"
    _launch("ddp", base, 2, "--trainer.max_epochs", "2")
    curves = {}
    for name, strategy in (("to_fsdp", "fsdp"), ("to_ddp", "ddp")):
        shutil.copytree(base, tmp_path / name)
        _launch(strategy, tmp_path / name, 2, "--trainer.max_epochs", "3", ckpt="last")
        curves[name] = metrics_lines(tmp_path / name)[2]
    for key in ("train/loss", "val/loss"):
        assert curves["to_fsdp"][key] == pytest.approx(curves["to_ddp"][key], rel=1e-5), key


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_accumulated_clipped_warmed_up_steps_equal_ddp_and_bf16_trains(tmp_path):
    """Clipping bites at 0.05 (the sharded norm must be the whole gradient's), accumulation skips the
    reduce-scatter on the first micro-batch, warmup ramps the lr: fsdp must equal ddp."""
    curves = {}
    for strategy in ("fsdp", "ddp"):
        _launch(strategy, tmp_path / strategy, 2, "--trainer.max_epochs", "2", *STEP_FEATURES)
        curves[strategy] = metrics_lines(tmp_path / strategy)
    for key in ("train/loss", "val/loss", "lr"):
        assert [m[key] for m in curves["fsdp"]] == pytest.approx([m[key] for m in curves["ddp"]], rel=1e-5), key
    _launch(
        "fsdp", tmp_path / "bf16", 2, "--trainer.max_epochs", "2", "--trainer.precision", "bf16-mixed", *STEP_FEATURES
    )
    bf16 = metrics_lines(tmp_path / "bf16")
    assert [m["train/loss"] for m in bf16] == pytest.approx([m["train/loss"] for m in curves["ddp"]], rel=0.05)


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_tied_weights_are_sharded_as_one_group_and_resume(tmp_path):
    """An output layer sharing the embedding's weight (GPT-2's tie): the two units are one FSDP group
    (sharded apart, FSDP refuses the shared parameter); training equals ddp's and resumes exactly."""
    yaml_file = Path(__file__).parent / "probe" / "tied_probe.yaml"

    def run(strategy: str, root: Path, *extra: str, ckpt: str | None = None) -> list[dict]:
        args = [
            "launch",
            "--nproc-per-node",
            "2",
            "-c",
            str(yaml_file),
            "--trainer.strategy",
            strategy,
            "--trainer.root_dir",
            str(root),
            *extra,
            *(["--ckpt-path", ckpt] if ckpt else []),
        ]
        assert_ok(run_unifit(*args, timeout=120))
        return metrics_lines(root)

    fsdp, ddp = run("fsdp", tmp_path / "fsdp"), run("ddp", tmp_path / "ddp")
    assert [m["train/loss"] for m in fsdp] == pytest.approx([m["train/loss"] for m in ddp], rel=1e-5)
    run("fsdp", tmp_path / "part", "--trainer.max_epochs", "1")
    resumed = run("fsdp", tmp_path / "part", ckpt="last")
    assert [m["train/loss"] for m in resumed] == pytest.approx([m["train/loss"] for m in fsdp], rel=1e-9)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"strategy_options": {"wrap": ["TransformerBlock"]}},
            "trainer.strategy_options.wrap: TransformerBlock names no submodule of ProbeModule; its submodule classes are: "
            "Dropout, Linear, Sequential, Tanh",
        ),
        ({"strategy_options": {"cpu_offload": True}}, "trainer.strategy_options.cpu_offload: true needs a GPU"),
        ({"precision": "16-mixed"}, "trainer.precision: received '16-mixed', which fsdp does not support"),
        ({"strategy_options": {"sharding": "zero3"}}, "trainer.strategy_options.sharding"),
    ],
)
def test_bad_fsdp_options_are_one_line(tmp_path, settings, message):
    """Checked in one process too (no launcher: a world of one, where nothing is sharded yet)."""
    from tests.probe.probe import ProbeModule
    from unifit import Trainer
    from unifit.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        Trainer(
            strategy="fsdp", max_epochs=1, batch_size=8, root_dir=str(tmp_path), progress_bar=False, **settings
        ).fit(ProbeModule())
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_hybrid_sharding_on_one_node_is_one_line_from_every_rank(tmp_path):
    result = launch_probe(
        "fsdp", tmp_path, "--trainer.max_epochs", "1", "--trainer.strategy_options", "{sharding: hybrid}", timeout=120
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        "trainer.strategy_options.sharding: 'hybrid' shards within a node and replicates across nodes, but this "
        "job has one node (2 ranks); use 'full'"
    ) in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.timeout(120)
def test_keras_module_under_fsdp_is_refused(tmp_path, cli):
    result = cli(
        "fit",
        "-c",
        str(Path(__file__).parent / "probe" / "keras_probe.yaml"),
        "--trainer.strategy",
        "fsdp",
        "--trainer.root_dir",
        str(tmp_path),
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "trainer.strategy: 'fsdp' trains torch modules" in result.stderr
    assert "use one of: single, horovod, mirrored, mwms" in result.stderr


def test_default_units_are_the_blocks_beside_a_models_own_parameters():
    """A model with parameters of its own beside a container of blocks (a GPT's position embedding, a ViT's class
    token) is looked into: its blocks and layers are the units, so no unit gathers the whole model; a module whose
    forward reads a child's weights directly (nn.MultiheadAttention's out_proj) stays whole."""
    from tests.probe.tiny_gpt import TinyGPT
    from unifit.strategies.fsdp import _children_with_parameters

    gpt = TinyGPT()
    names = {id(m): name for name, m in gpt.named_modules()}
    units = [names[id(u)] for u in _children_with_parameters(gpt)]
    assert units == ["net.embed", "net.blocks.0", "net.blocks.1", "net.norm", "net.head"]
    model = torch.nn.Module()
    model.attn, model.head = torch.nn.MultiheadAttention(8, 2), torch.nn.Linear(8, 2)
    assert list(_children_with_parameters(model)) == [model.attn, model.head]
