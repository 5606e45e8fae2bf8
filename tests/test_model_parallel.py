"""strategy: model-parallel on CPU (gloo, real torchrun ranks): tensor parallelism x FSDP2 on one DeviceMesh.

A small GPT (tests/probe/tiny_gpt.py) split by a YAML plan, and the same network as a LightningModule written
for Lightning's ModelParallelStrategy (its own configure_model), each against ddp of the same global batch: the
clipped, accumulated, warmed-up steps agree, logged values count each sample once, the DCP checkpoint resumes
under model-parallel, fsdp and ddp; without data parallelism (TP4) it matches one process, in bf16-mixed too."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, assert_ok, metrics_lines, run_together, run_unifit
from tests.probe.tiny_gpt import LLAMA_SEQUENCE_PLAN, PLAN, SEQUENCE_PLAN, TinyGPT
from unifit.strategies.sharded_state import read_whole

YAML = REPO / "tests" / "probe" / "tiny_gpt.yaml"
# ddp's float32 sums in another order: what the layouts may differ by after 6 steps
CLOSE = 2e-5
LAYOUT = {"tensor_parallel": 2, "plan": PLAN}  # 2 x 2 on 4 ranks
# val_samples counted by a torchmetrics SumMetric instead of a logged sum: only where a layout's metric states are
# the point (importing torchmetrics costs each rank seconds)
TORCHMETRICS_VAL = ("--module.init_args.torchmetrics_val", "true")


def _args(root: Path, strategy: str, procs: int, *overrides: str, options: dict | None = None, ckpt: str | None = None):
    args = ["fit"] if procs == 1 else ["launch", "--nproc-per-node", str(procs)]
    args += ["-c", str(YAML), "--trainer.strategy", strategy, "--trainer.root_dir", str(root)]
    args += ["--trainer.export_dir", str(root / "export"), *overrides]
    if options:
        args += ["--trainer.strategy_options", json.dumps(options)]
    return [*args, *(["--ckpt-path", ckpt] if ckpt else [])]


def _run(root: Path, strategy: str, procs: int, *overrides: str, options: dict | None = None, ckpt: str | None = None):
    result = run_unifit(*_args(root, strategy, procs, *overrides, options=options, ckpt=ckpt), timeout=240)
    assert_ok(result)
    return result


def _run_together(*runs: list[str]) -> list:
    """Independent runs (each `_args(...)`) at the same time: one's start-up and rendezvous overlap the other's steps
    on this 2-core machine. Each must succeed."""
    results = run_together([(args, {}) for args in runs], timeout=300)
    for result in results:
        assert_ok(result)
    return results


def _weights(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root / "export" / "model.pt", weights_only=True)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _predicted_whole(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """TinyGPT's predictions of its predict dataset, in order, with `weights`, in this process."""
    module = TinyGPT()
    module.load_state_dict(weights)
    (seqs,) = module.predict_dataset().tensors
    with torch.no_grad():
        predicted = module.predict_step((seqs,), 0)
    assert len(predicted) == 32
    return predicted


def _checkpoint(root: Path, epoch: int) -> str:
    return str(next((root / "checkpoints").glob(f"epoch={epoch:04d}-*")))


@pytest.mark.launch
@pytest.mark.timeout(600)
def test_tensor_x_data_parallel_plan_matches_ddp_and_its_checkpoint_resumes_on_other_layouts(tmp_path):
    # 17 validation sequences: one replica takes 2 batches, the other 1; a rank's extra forward must not gather alone
    uneven = ("--module.init_args.n_val", "17")
    ddp, tp = tmp_path / "ddp", tmp_path / "tp2xdp2"
    # tp2xdp2 recomputes its blocks' activations (selective, after the split, before fsdp) and still equals ddp;
    # its checkpoint resumes without it, and on fsdp with full activation checkpointing and compiled blocks
    selective = ("--trainer.activation_checkpointing", "selective")
    _, out = _run_together(
        _args(ddp, "ddp", 2, *uneven),
        _args(
            tp, "model-parallel", 4, "--trainer.max_epochs", "2", *uneven, *TORCHMETRICS_VAL, *selective, options=LAYOUT
        ),
    )
    assert "activation checkpointing: selective, on net.blocks.0, net.blocks.1" in out.stderr, out.stderr
    assert "4 rank(s) = 2 data-parallel x 2 tensor-parallel" in out.stderr, out.stderr
    assert "14 layer(s) split over 2 ranks" in out.stderr, out.stderr
    assert "global batch 32" in out.stdout + out.stderr  # 2 replicas x 8 x 2 accumulated, as ddp's 2 ranks
    ckpt = _checkpoint(tp, 2)
    assert sorted(p.name for p in (Path(ckpt) / "shards").iterdir()) == [".metadata"] + [
        f"__{r}_0.distcp" for r in range(4)
    ]
    # resumed with sequence parallelism added: the residual stream, the norms and their gradients on half the tokens
    resumed = tmp_path / "resumed"
    shapes = ("--trainer.callbacks", "[{class_path: tests.probe.tiny_gpt.NormInputShapes}]")
    out = _run(resumed, "model-parallel", 4, *shapes, *uneven, options={**LAYOUT, "plan": SEQUENCE_PLAN}, ckpt=ckpt)
    assert "(8 colwise, 1 colwise_gather, 1 rowwise, 4 rowwise_sequence, 7 sequence)" in out.stderr, out.stderr
    for rank in range(4):  # a micro-batch of 8 sequences of 16 positions: 8 of them on each tensor-parallel rank
        assert json.loads((resumed / f"norm_input_rank{rank}.json").read_text()) == [[8, 8, 32]]
    on_fsdp = tmp_path / "on_fsdp"
    # predict on 2 ranks of one replica (both predict every sample): each sample once, in order, as the whole model
    out = tmp_path / "split.pkl"
    args = ["launch", "--run", "predict", "--nproc-per-node", "2", "-c", str(YAML), "--trainer.strategy"]
    args += ["model-parallel", "--trainer.root_dir", str(tmp_path / "split"), "--ckpt-path", ckpt, "--output", str(out)]
    full = ("--trainer.activation_checkpointing", "full", "--trainer.compile", "blocks")
    fsdp_out, _ = _run_together(
        _args(on_fsdp, "fsdp", 2, *uneven, *full, ckpt=ckpt), [*args, "--trainer.strategy_options", json.dumps(LAYOUT)]
    )
    assert "activation checkpointing: full, on net.blocks.0, net.blocks.1" in fsdp_out.stderr, fsdp_out.stderr
    assert "compile: blocks: 2 block(s) compiled one by one (net.blocks.0, net.blocks.1)" in fsdp_out.stderr
    assert "compile: blocks: 1 graph(s) compiled in this fit" in fsdp_out.stderr, fsdp_out.stderr
    assert torch.equal(pickle.loads(out.read_bytes()), _predicted_whole(_weights(tp))), "not one process's predictions"
    reference = _weights(ddp)
    for root in (resumed, on_fsdp):
        assert _max_diff(_weights(root), reference) < CLOSE, root.name
    ddp_lines, tp_lines = metrics_lines(ddp), metrics_lines(tp) + metrics_lines(resumed)
    assert [line["epoch"] for line in tp_lines] == [1, 2, 3]
    for mine, theirs in zip(tp_lines, ddp_lines):
        assert mine["samples_seen"] == 64.0  # logged with reduce_fx="sum": each sample once, not per tensor rank
        assert mine["val_samples"] == 17.0  # tp's a torchmetrics SumMetric: one state per replica gathered
        assert mine["lr"] == theirs["lr"] == pytest.approx(0.012)  # scaled by the 2 replicas' global batch
        for key in ("train/loss", "val_loss"):
            assert mine[key] == pytest.approx(theirs[key], abs=1e-5), key
    assert metrics_lines(on_fsdp)[-1]["val_loss"] == pytest.approx(ddp_lines[-1]["val_loss"], abs=1e-5)


@pytest.mark.launch
@pytest.mark.timeout(500)
def test_a_module_written_for_lightnings_model_parallel_strategy_runs_unchanged(tmp_path):
    """Its configure_model splits the layers over self.device_mesh and shards them with fully_shard itself; the same
    LightningModule unsplit runs unchanged in pipeline stages."""
    whole, split, staged = tmp_path / "whole", tmp_path / "split", tmp_path / "staged"
    whole_module = ("--module.class_path", "tests.probe.tiny_gpt_lightning.LightningWhole")
    tp_module = ("--module.class_path", "tests.probe.tiny_gpt_lightning.LightningTP")
    _, out = _run_together(
        _args(whole, "ddp", 2, *whole_module),
        _args(split, "model-parallel", 4, *tp_module, options={"tensor_parallel": 2}),
    )
    assert "configure_model() sharded the model with fully_shard itself" in out.stderr, out.stderr
    # the unsplit module, unchanged, in 2 pipeline stages x 2 replicas (its steps call self.net: the pipeline's)
    _run(staged, "model-parallel", 4, *whole_module, options={"pipeline_parallel": 2, "split_points": ["net.blocks.1"]})
    for root in (split, staged):
        assert _max_diff(_weights(root), _weights(whole)) < CLOSE, root.name
        for mine, theirs in zip(metrics_lines(root), metrics_lines(whole), strict=True):
            assert mine["train_loss"] == pytest.approx(theirs["train_loss"], abs=1e-5)
            assert mine["val_loss"] == pytest.approx(theirs["val_loss"], abs=1e-5)
    # validate from its last checkpoint: configure_model splits again, the shards load into the split model
    checked = tmp_path / "validated"
    result = run_unifit(  # on 2 ranks: the 2 x 2 shards read into one replica split over 2
        "launch", "--run", "validate", "--nproc-per-node", "2", "-c", str(YAML), "--trainer.root_dir", str(checked),
        "--module.class_path", "tests.probe.tiny_gpt_lightning.LightningTP", "--trainer.strategy", "model-parallel",
        "--trainer.strategy_options", '{"tensor_parallel": 2}', "--ckpt-path", _checkpoint(split, 3), timeout=200,
    )  # fmt: skip
    assert_ok(result)
    validated = json.loads((checked / "validate.json").read_text())
    assert validated["metrics"]["val_loss"] == pytest.approx(metrics_lines(split)[-1]["val_loss"], abs=1e-6)


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_a_transformers_model_split_by_its_own_plan_over_every_rank_matches_one_process_in_bf16_mixed(tmp_path):
    """A Hugging Face Llama (transformers' code, tied embeddings) in a tutorial-style LightningModule, `plan: auto`:
    its own `_tp_plan` over 4 ranks (no data parallelism, so no FSDP; the norms' weights are plain tensors on every
    rank beside the split ones, and clipping combines a mesh's norm with a plain one); one process trains the
    same global batch. The tied head and embedding stay one weight."""
    llama = (
        "--module.class_path",
        "tests.probe.tiny_gpt_lightning.TransformersLlama",
        "--trainer.precision",
        "bf16-mixed",
    )
    one, tp4 = tmp_path / "one", tmp_path / "tp4"
    _, out = _run_together(
        _args(one, "single", 1, *llama),
        _args(tp4, "model-parallel", 4, *llama, options={"tensor_parallel": 4, "plan": "auto"}),
    )
    assert "16 layer(s) split over 4 ranks (10 colwise, 1 colwise_gather, 5 rowwise)" in out.stderr, out.stderr
    weights = {name: _weights(root) for name, root in (("one", one), ("tp4", tp4))}
    assert torch.equal(weights["tp4"]["model.lm_head.weight"], weights["tp4"]["model.model.embed_tokens.weight"])
    # bf16 rounds differently when a matmul is split: close, not equal (float32 agrees to 3e-6, see above)
    assert _max_diff(weights["tp4"], weights["one"]) < 2e-2
    assert _max_diff(weights["one"], _initial_llama()) > 0.05  # it trained
    for mine, theirs in zip(metrics_lines(tp4), metrics_lines(one), strict=True):
        assert mine["samples_seen"] == 64.0
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], abs=1e-2)


def _initial_llama() -> dict[str, torch.Tensor]:
    from tests.probe.tiny_gpt_lightning import TransformersLlama

    return {f"model.{k}": v for k, v in TransformersLlama().model.state_dict().items()}


@pytest.mark.launch
@pytest.mark.timeout(600)
def test_pipeline_x_data_parallel_matches_ddp_and_its_checkpoint_resumes_on_other_layouts(tmp_path):
    """2 pipeline stages x 2 replicas, 4 micro-batches of a batch: tied weights (the embedding on the first stage,
    the head reading it on the last), a last training and validation batch that 4 micro-batches cannot cut (the
    most equal parts), clipping, accumulation and warmup; against ddp on 2 ranks of the same global batch. Its
    checkpoint resumes on the 3-D layout (8 ranks: tensor parallelism added inside each stage's replicas, and the
    blocks sharded over them), under fsdp, and validates on 2 ranks of one replica.

    A replica's epoch is 3 batches of 8 and one of 2, the second of an accumulation window: a new shape builds a
    new schedule in mid-window (torch's shape inference once cleared sharded blocks' gradients there). Batches are
    cut to lengths of their own (ragged): the replicas of a stage build for different shapes at the same step, and
    sharded blocks build together. Validation is 17 and 16 sequences: one replica has a batch more."""
    data = ("--module.init_args.tied", "true", "--module.init_args.n_train", "52", "--module.init_args.n_val", "33")
    data += ("--module.init_args.ragged", "true")
    ddp, staged = tmp_path / "ddp", tmp_path / "pp2xdp2"
    layout = {"pipeline_parallel": 2, "microbatches": 4}
    _, out = _run_together(
        _args(ddp, "ddp", 2, *data),
        _args(staged, "model-parallel", 4, *data, "--trainer.max_epochs", "2", *TORCHMETRICS_VAL, options=layout),
    )
    assert "4 rank(s) = 2 pipeline stages x 2 data-parallel x 1 tensor-parallel" in out.stderr, out.stderr
    assert "net split into 2 stages at net.blocks.1 (1f1b schedule)" in out.stderr, out.stderr
    assert "1 parameter(s) held by several stages (tied weights)" in out.stderr, out.stderr
    ckpt = _checkpoint(staged, 2)
    assert (Path(ckpt) / "shards" / ".metadata").is_file()  # DCP's: every rank wrote its part
    # resumed on the 3-D layout: 2 stages x the same 2 replicas x 2 tensor-parallel ranks on 8 ranks, the other
    # schedule; the stages built from the blocks, each block sharded over the stage's replicas by FSDP2 (the LR
    # scaled by the 2 replicas still)
    resumed = tmp_path / "resumed"
    cube = {**layout, **LAYOUT, "schedule": "gpipe"}
    on_fsdp = tmp_path / "on_fsdp"
    out, _ = _run_together(
        _args(resumed, "model-parallel", 8, *data, options=cube, ckpt=ckpt), _args(on_fsdp, "fsdp", 2, *data, ckpt=ckpt)
    )
    assert "8 rank(s) = 2 pipeline stages x 2 data-parallel x 2 tensor-parallel" in out.stderr, out.stderr
    assert "each stage's blocks sharded over its 2 data-parallel ranks (FSDP2)" in out.stderr, out.stderr
    reference = _weights(ddp)
    for root in (resumed, on_fsdp):
        assert _max_diff(_weights(root), reference) < CLOSE, root.name
    assert torch.equal(_weights(resumed)["net.head.weight"], _weights(resumed)["net.embed.weight"])  # still tied
    staged_lines = metrics_lines(staged) + metrics_lines(resumed)
    assert [line["epoch"] for line in staged_lines] == [1, 2, 3]
    for mine, theirs in zip(staged_lines, metrics_lines(ddp), strict=True):
        assert mine["samples_seen"] == 52.0  # reduce_fx="sum" per micro-batch: each sample once, on the last stage
        assert mine["val_samples"] == 33.0  # staged's a torchmetrics SumMetric: the last stage's states only
        assert mine["lr"] == theirs["lr"] == pytest.approx(0.012)  # scaled by the 2 replicas
        for key in ("train/loss", "val_loss"):
            assert mine[key] == pytest.approx(theirs[key], abs=1e-5), key
    # validate the 3-D run's checkpoint (blocks sharded and split) on 2 ranks of one replica, in traced stages:
    # the whole model on each, each sample counted once
    checked = tmp_path / "validated"
    args = ["launch", "--run", "validate", "--nproc-per-node", "2", "-c", str(YAML), *data, "--trainer.root_dir"]
    args += [str(checked), "--trainer.strategy", "model-parallel", "--ckpt-path", _checkpoint(resumed, 3)]
    assert_ok(run_unifit(*args, "--trainer.strategy_options", json.dumps({"pipeline_parallel": 2}), timeout=200))
    validated = json.loads((checked / "validate.json").read_text())["metrics"]
    assert validated["val_samples"] == 33.0
    assert validated["val_loss"] == pytest.approx(metrics_lines(resumed)[-1]["val_loss"], abs=1e-6)


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_four_pipeline_stages_built_from_the_blocks_match_one_process_in_bf16_mixed(tmp_path):
    """4 stages (an even split of the 4 blocks) built from the blocks, not traced (`stages: blocks`: the middle
    stages pass the blocks before them through and end at the block after them; the embedding, the position
    table and the head are every stage's, their gradients summed), the GPipe schedule, 4 micro-batches, no data
    parallelism."""
    deeper = ("--module.init_args.layers", "4", "--trainer.precision", "bf16-mixed")
    one, staged = tmp_path / "one", tmp_path / "pp4"
    options = {"pipeline_parallel": 4, "schedule": "gpipe", "microbatches": 4, "stages": "blocks"}
    _, out = _run_together(
        _args(one, "single", 1, *deeper), _args(staged, "model-parallel", 4, *deeper, options=options)
    )
    assert "net split into 4 stages at net.blocks.1, net.blocks.2, net.blocks.3" in out.stderr, out.stderr
    assert "stage 2 of 4 runs blocks 2-2 of self.net.blocks" in out.stderr, out.stderr
    assert "5 parameter(s) held by several stages (the network's outside its blocks)" in out.stderr, out.stderr
    assert _max_diff(_weights(staged), _weights(one)) < 2e-2  # bf16 (float32: 1e-5 above)
    for mine, theirs in zip(metrics_lines(staged), metrics_lines(one), strict=True):
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], abs=1e-3)


@pytest.fixture(scope="module")
def one_tied(tmp_path_factory) -> Path:
    """One process of TinyGPT with its embedding tied to its head: the reference of the tests below."""
    one = tmp_path_factory.mktemp("one_tied")
    _run(one, "single", 1, "--module.init_args.tied", "true")
    return one


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_network_taking_the_targets_and_returning_logits_and_loss_runs_in_stages(tmp_path, one_tied):
    """nanoGPT's convention (transformers' too, with `labels`): the step passes the targets into the network, which
    returns (logits, loss). The targets enter stage 0 and travel with the activations to the last stage, where the
    loss is computed; the step gets the tuple back. The embedding is tied to the head across the 2 stages. Against
    one process of the same batch (tests/probe/tiny_gpt.py: TargetsGPT has TinyGPT's weights)."""
    tied = ("--module.init_args.tied", "true")
    one, staged = one_tied, tmp_path / "staged"
    targets = ("--module.class_path", "tests.probe.tiny_gpt.TargetsGPT", *tied)
    _run(staged, "model-parallel", 2, *targets, options={"pipeline_parallel": 2, "microbatches": 4})
    weights = _weights(staged)
    assert torch.equal(weights["net.head.weight"], weights["net.embed.weight"])
    assert _max_diff(weights, _weights(one)) < CLOSE
    for mine, theirs in zip(metrics_lines(staged), metrics_lines(one), strict=True):
        assert mine["samples_seen"] == 64.0
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], abs=1e-5)


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_tensor_x_pipeline_parallel_matches_one_process_and_resumes_on_other_layouts(tmp_path, one_tied):
    """TP2 x PP2 on 4 ranks (torchtitan's layout without data parallelism): each of the 2 stages, built from the
    blocks, has its layers split over its 2 tensor-parallel ranks by the YAML plan (the embedding and the head,
    tied, on both stages); clipping, accumulation and warmup. Against one process of the same global batch; its
    checkpoint (sharded: each rank writes its stage's part) resumes under TP2 x PP2 on the other schedule and in one
    process."""
    tied = ("--module.init_args.tied", "true")
    one = one_tied
    staged = tmp_path / "tp2xpp2"
    layout = {**LAYOUT, "pipeline_parallel": 2, "microbatches": 4}
    early = ("--trainer.callbacks", "[{class_path: tests.probe.tiny_gpt.SavedBeforeTheFirstBatch}]")
    out = _run(staged, "model-parallel", 4, *tied, *early, options=layout)
    assert "4 rank(s) = 2 pipeline stages x 1 data-parallel x 2 tensor-parallel" in out.stderr, out.stderr
    assert "8 layer(s) split over 2 ranks (4 colwise, 1 colwise_gather, 3 rowwise)" in out.stderr, out.stderr
    assert "stage 1 of 2 runs blocks 1-1 of self.net.blocks" in out.stderr, out.stderr
    reference = _weights(one)
    weights = _weights(staged)
    assert torch.equal(weights["net.head.weight"], weights["net.embed.weight"])  # still one weight
    assert _max_diff(weights, reference) < CLOSE  # measured 1.6e-6
    for mine, theirs in zip(metrics_lines(staged), metrics_lines(one), strict=True):
        assert (mine["samples_seen"], mine["val_samples"]) == (64.0, 32.0)  # each sample once, not per rank
        for key in ("train/loss", "val_loss"):
            assert mine[key] == pytest.approx(theirs[key], abs=1e-5), key
    # the checkpoint before the first batch (a stage's layers split, the other stages' whole still): the start
    start = read_whole(str(next((staged / "checkpoints").glob("start*")) / "shards"), {})["model"]
    initial = {f"net.{k}": v for k, v in TinyGPT(tied=True).net.state_dict().items()}
    assert _max_diff({k: v for k, v in start.items() if k in initial}, initial) == 0.0
    ckpt = _checkpoint(staged, 2)
    assert (Path(ckpt) / "shards" / ".metadata").is_file()  # DCP's: every rank wrote its part
    resumed, alone = tmp_path / "resumed", tmp_path / "alone"
    _run_together(
        _args(resumed, "model-parallel", 4, *tied, options={**layout, "schedule": "gpipe"}, ckpt=ckpt),
        _args(alone, "single", 1, *tied, ckpt=ckpt),
    )
    for root in (resumed, alone):
        assert _max_diff(_weights(root), reference) < CLOSE, root.name


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_transformers_llama_runs_in_stages_built_from_its_blocks_and_matches_one_process(tmp_path):
    """transformers' Llama (its code unchanged, tied embeddings, `labels` into the model, the loss inside it): torch's
    tracer builds a stage that cannot run (its rotary embedding called without inputs), so unifit builds the 2
    stages from its decoder layers; each stage computes the rotary table and the mask itself. Against one process.
    The same against 2 tensor-parallel ranks with a hand-written sequence-parallel plan (LLAMA_SEQUENCE_PLAN)."""
    llama = ("--module.class_path", "tests.probe.tiny_gpt_lightning.TransformersLlama")
    one, staged, sequence = tmp_path / "one", tmp_path / "staged", tmp_path / "sequence"
    _, out = _run_together(
        _args(one, "single", 1, *llama),
        _args(sequence, "model-parallel", 2, *llama, options={"tensor_parallel": 2, "plan": LLAMA_SEQUENCE_PLAN}),
    )
    assert "(10 colwise, 1 colwise_gather, 1 rowwise, 4 rowwise_sequence, 7 sequence)" in out.stderr, out.stderr
    assert _max_diff(_weights(sequence), _weights(one)) < CLOSE  # measured 8.4e-7
    out = _run(staged, "model-parallel", 2, *llama, options={"pipeline_parallel": 2, "microbatches": 4})
    # (torch 2.13's tracer builds a stage that cannot run; 2.11's fails otherwise: the reason is torch's)
    assert "torch's tracer cannot build the stages (" in out.stderr, out.stderr
    assert "built from the blocks of self.model.model.layers instead" in out.stderr, out.stderr
    weights = _weights(staged)
    assert torch.equal(weights["model.lm_head.weight"], weights["model.model.embed_tokens.weight"])
    assert _max_diff(weights, _weights(one)) < CLOSE  # measured 7.6e-7
    assert _max_diff(weights, _initial_llama()) > 0.05  # it trained
    for mine, theirs in zip(metrics_lines(staged), metrics_lines(one), strict=True):
        assert mine["samples_seen"] == 64.0
        for key in ("train_loss", "val_loss"):
            assert mine[key] == pytest.approx(theirs[key], abs=1e-5), key


# each: the layout, and what the first error line on every rank says
BAD_STAGES_OR_SPLITS = [
    (
        {"pipeline_parallel": 2, "split_points": ["net.layers.1"]},
        ["split_points: 'net.layers.1' names no submodule of TinyGPT", "net.blocks"],
    ),
    ({"pipeline_parallel": 2, "microbatches": 3}, ["microbatches: 3 does not divide a training batch of 8 rows"]),
    (  # the first block's output read after the last: a later stage passes block 0 through, so it would differ
        {"pipeline_parallel": 2, "stages": "blocks", "cli": ["--module.init_args.skip", "true"]},
        ["self.net split into stages at its blocks does not compute what it computes whole", "skip connection"],
    ),
    (
        {"pipeline_parallel": 2, "stages": "blocks", "split_points": ["net.norm"]},
        ["stages: blocks needs split points that are items of one list of blocks", "net.norm"],
    ),
    (  # a colwise layer on stage 0, the rowwise one reading it on stage 1: the handed-on activation is split
        {
            "pipeline_parallel": 2,
            "tensor_parallel": 2,
            "nproc": 4,
            "plan": {"net.0": "colwise", "net.2": "rowwise"},
            "cli": ["--module.class_path", "tests.probe.soak_torch.SoakModule"],
        },
        ["self.net cannot run with only this stage's layers split", "must lie in one stage"],
    ),
    (  # sequence parallelism whose blocks are not planned: the residual add meets the attention's shards
        {"tensor_parallel": 2, "plan": {k: v for k, v in SEQUENCE_PLAN.items() if k != "net.blocks.*"}},
        ["aten.add.Tensor in net.blocks.0's forward met activations cut along the sequence", "residual add"],
    ),
]


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_bad_stage_or_split_input_is_one_line_on_every_rank(tmp_path):
    """Each refused in its own launch; the launches run at once (they end at set-up)."""
    commands = []
    for i, (options, _) in enumerate(BAD_STAGES_OR_SPLITS):
        options = dict(options)
        extra, procs = options.pop("cli", []), str(options.pop("nproc", 2))
        commands.append((["launch", "--nproc-per-node", procs, *_layout(tmp_path / str(i), options), *extra], {}))
    results = run_together(commands, timeout=300)
    for i, ((_, needles), result) in enumerate(zip(BAD_STAGES_OR_SPLITS, results, strict=True)):
        assert result.returncode != 0, (i, result.stdout)
        errors = [line for line in result.stderr.splitlines() if line.startswith("unifit: error")]
        assert errors and all(needle in errors[0] for needle in needles), (i, result.stderr)
        assert "Traceback" not in result.stderr and not (tmp_path / str(i) / "checkpoints").exists(), i


def _refused(result, *needles: str) -> None:
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("unifit: error")]
    assert errors and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.mark.parametrize(
    ("options", "needles"),
    [
        (
            {"plan": {"net.blocks.*.attn.query": "colwise"}},
            ["'net.blocks.*.attn.query' names no submodule", "net.embed"],
        ),
        ({"plan": {"net.norm": "colwise"}}, ["matches net.norm, a LayerNorm", "only Linear and Embedding"]),
        ({"plan": {"net.head": "diagonal"}}, ["trainer.strategy_options.plan", "colwise_gather"]),
        ({"tensor_parallel": 2}, ["tensor_parallel: 2 does not divide the world size 1"]),
        ({"data_parallel": 2}, ["data_parallel: 2 x tensor_parallel 1 x pipeline_parallel 1 is not the world size 1"]),
        ({"pipeline_parallel": 2}, ["tensor_parallel 1 x pipeline_parallel 2 does not divide the world size 1"]),
        (
            {"pipeline_parallel": 2, "tensor_parallel": 2, "stages": "trace"},
            ["tensor_parallel 2 and stages: trace", "set stages: blocks"],
        ),
        ({"split_points": ["net.blocks.1"]}, ["split_points split a pipeline: set pipeline_parallel above 1"]),
        ({"stages": "blocks"}, ["stages split a pipeline: set pipeline_parallel above 1"]),
        ({"tensor_parallel": 2, "share_gpus": True}, ["share_gpus with tensor_parallel 2", "one GPU per rank"]),
        ({"pipeline_parallel": 2, "share_gpus": True}, ["share_gpus with pipeline_parallel 2", "one GPU per rank"]),
        ({"plan": "auto"}, ["plan: auto, but nothing in TinyGPT carries a tensor-parallel plan", "_tp_plan"]),
        (
            {"pipeline_parallel": 2, "tensor_parallel": 2, "plan": {"net.head": "rowwise_sequence"}},
            ["pipeline_parallel 2 with a sequence-parallel plan", "use rowwise instead of rowwise_sequence"],
        ),
    ],
)
def test_bad_layouts_and_plans_are_one_line_before_any_step(cli, tmp_path, options, needles):
    _refused(cli("fit", *_layout(tmp_path, options)), *needles)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    ("plan", "needles"),
    [
        (
            {"model.lm_head": "colwise_gather"},
            ["model.lm_head and model.model.embed_tokens share one weight", "not split"],
        ),
        (
            {"model.lm_head": "colwise", "model.model.embed_tokens": "colwise"},
            ["splits differently (model.lm_head colwise, model.model.embed_tokens colwise)"],
        ),
    ],
)
def test_a_plan_that_would_untie_a_tied_weight_is_one_line(cli, tmp_path, plan, needles):
    """Tied embeddings split alike (the vocabulary's rows) stay one weight; split one way and not the other, the
    two layers would train two copies: refused."""
    llama = ("--module.class_path", "tests.probe.tiny_gpt_lightning.TransformersLlama")
    _refused(cli("fit", *_layout(tmp_path, {"plan": plan}), *llama), *needles)


def _layout(root: Path, options: dict) -> list[str]:
    return ["-c", str(YAML), "--trainer.root_dir", str(root), "--trainer.strategy", "model-parallel"] + [
        "--trainer.strategy_options",
        json.dumps(options),
    ]


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_tensor_parallel_with_nothing_split_is_refused(tmp_path):
    """Two ranks of one replica that split nothing would each compute the whole model: refused, not wasted."""
    result = run_unifit("launch", "--nproc-per-node", "2", *_layout(tmp_path, {"tensor_parallel": 2}), timeout=100)
    assert result.returncode != 0
    assert "tensor_parallel: 2, but nothing in TinyGPT is split" in result.stderr, result.stderr
