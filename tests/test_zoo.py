"""The model zoo (tests/zoo/torch_models.py): Lightning's own demos (BoringModel, Transformer, LSTM with its
batch sampler, ManualOptimBoringModel), Hugging Face GPT-2 and BERT, a ResNet-18 with BatchNorm, all as their
authors wrote them (LightningModules, their own DataLoaders), and modules that take part in their own step
(a GAN in manual optimization with two optimizers, a classifier with every hook inside the optimizer step:
tests/zoo/own_step_models.py), Lightning's GLUE tutorial module, which logs its metrics in on_validation_epoch_end
(tests/zoo/logging_models.py), a class-imbalanced data module rebalanced by its own WeightedRandomSampler, and a
classifier that brings its own Lightning callbacks (tests/zoo/callback_models.py), a classifier fed by two training
loaders at once (a dict, Lightning's CombinedLoader), a backbone unfrozen mid-training by Lightning's
BackboneFinetuning,
trained by unifit under every torch strategy in several precisions. One launch per strategy runs the whole zoo in one interpreter per rank (tests/zoo/run_torch_zoo.py).

What must hold, model by model:
- single process equals Lightning's own Trainer, bit for bit (32-true and bf16-mixed, accumulating 2);
- ddp (2 ranks x batch 4) takes the same steps as single (batch 4, accumulating 2): the same losses;
- fsdp, smddp-like and horovod end with ddp's weights (BatchNorm's too), and every rank holds the same model;
- a crash mid-epoch and a resume from the last checkpoint ends where the uninterrupted run ends;
- what cannot run is refused in one line (fsdp 16-mixed; float16 nn.LSTM on CPU)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest

from tests.helpers import assert_ok, run_at_most
from tests.zoo.recording import ZooResults

pytestmark = pytest.mark.launch

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

DRIVER = "tests/zoo/run_torch_zoo.py"
MODELS = (
    "boring",
    "transformer",
    "lstm",
    "gpt2",
    "bert",
    "resnet",
    "manual-boring",
    "gan",
    "hooks",
    "glue",
    "callbacks",
    "imbalanced",
    "two-sources",
    "finetuning",
)
SAMPLED = {"imbalanced"}  # a WeightedRandomSampler of the user's: drawn unlike Lightning, and per world size
MANUAL = {"manual-boring", "gan"}  # trained without accumulation everywhere (refused with manual optimization)
BATCH_NORM = {"resnet"}  # running statistics follow each rank's batches: compared only between world-2 runs
# losses of the first steps single vs ddp (roundoff grows with the steps: the demo Transformer's SGD at lr 0.1
# multiplies a 1e-7 difference about 5x a step), and final weights where the training is not chaotic
EARLY_STEPS, STABLE = 4, ("boring", "gpt2", "bert")
LAUNCHES = {  # strategy -> (precisions, extra driver args)
    "single": ("32-true,bf16-mixed", ["--accumulate", "2", "--resume", "--lightning"]),
    "ddp": ("32-true,bf16-mixed,16-mixed", ["--resume"]),
    # bf16-mixed gathers parameters in bfloat16 as on a GPU (auto: float32 on CPU): norm layers kept in float32,
    # a backbone unfrozen after the first step given its gradient dtypes
    "fsdp": (
        "32-true,bf16-mixed,16-mixed",
        ["--resume", "--checks", "--strategy-options", '{"param_dtype": "bfloat16"}'],
    ),
    "smddp-like": ("32-true,16-mixed", ["--strategy-options", json.dumps({"local_world_size": 1})]),
    "horovod": ("32-true,16-mixed", ["--resume"]),
}
REFUSED = {("fsdp", "16-mixed"): "which fsdp does not support", (None, "16-mixed", "lstm"): "no float16 CPU kernel"}


class Zoo(ZooResults):
    """One launch's records, and the weights rank 0 saved."""

    def weights(self, model: str, precision: str, kind: str = "unifit") -> dict:
        return torch.load(self.out / f"{model}.{precision}.{kind}.pt")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Callable[[str], Zoo]:
    """zoo(strategy) -> the zoo under `strategy`. Every strategy's is launched at the first use, two at a time (one's
    start-up and rendezvous are the other's training)."""
    outs = {name: tmp_path_factory.mktemp(f"zoo-{name}") for name in LAUNCHES}
    commands = []
    for name, (precisions, extra) in LAUNCHES.items():
        driver = [DRIVER, "--out", str(outs[name]), "--precisions", precisions, *extra]
        if name == "single":  # the script as a user runs it: python, no launcher
            commands.append((driver, {"OMP_NUM_THREADS": "2"}))
        else:
            commands.append(
                (["-m", "unifit", "launch", "--nproc-per-node", "2", "--strategy", name, "--", *driver], {})
            )
    launched = dict(zip(LAUNCHES, run_at_most(2, commands, timeout=600), strict=True))

    def records(strategy: str) -> Zoo:
        assert_ok(launched[strategy])
        return Zoo(outs[strategy], 1 if strategy == "single" else 2)

    return records


def _max_diff(a: dict, b: dict, skip_buffers: bool = False) -> float:
    assert a.keys() == b.keys()
    keys = [k for k in a if a[k].is_floating_point() and not (skip_buffers and "running_" in k)]
    return max((a[k] - b[k]).abs().max().item() for k in keys)


def _step_losses(record: dict, micro: int) -> list[float]:
    """Each optimizer step's loss: the mean of its micro-batches."""
    losses = record["losses"]
    return [sum(losses[i : i + micro]) / micro for i in range(0, len(losses), micro)]


def _expected_refusal(strategy: str, precision: str, model: str) -> str | None:
    return REFUSED.get((strategy, precision)) or REFUSED.get((None, precision, model))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", list(LAUNCHES))
def test_every_model_trains_or_is_refused_in_one_line(strategy, zoo):
    z = zoo(strategy)
    precisions = LAUNCHES[strategy][0].split(",")
    for model in MODELS:
        for precision in precisions:
            for rank, results in enumerate(z.ranks):
                record = results[f"{model}/{precision}/unifit"]
                refusal = _expected_refusal(strategy, precision, model)
                if refusal:
                    assert refusal in record.get("error", ""), (model, precision, record)
                    assert "\n" not in record["error"]
                    continue
                assert "error" not in record, (strategy, model, precision, rank, record)
                assert record["losses"] and all(math.isfinite(x) for x in record["losses"]), (model, precision)
                assert record["digest"] == z.ranks[0][f"{model}/{precision}/unifit"]["digest"], (
                    f"{strategy} {model} {precision}: rank {rank} ends with another model than rank 0"
                )


@pytest.mark.timeout(900)
def test_single_equals_lightnings_own_trainer(zoo):
    z = zoo("single")
    for model in MODELS:
        for precision in ("32-true", "bf16-mixed"):
            assert "error" not in z.record(model, precision, "lightning"), z.record(model, precision, "lightning")
            if model in SAMPLED:
                continue
            diff = _max_diff(z.weights(model, precision), z.weights(model, precision, "lightning"))
            assert diff == 0.0, f"{model} {precision}: unifit's weights differ from Lightning's by {diff}"
    # the hooks inside the optimizer step, accumulating 2: called in Lightning's order, as often
    ours, theirs = z.record("hooks", "32-true")["calls"], z.record("hooks", "32-true", "lightning")["calls"]
    assert ours == theirs, (ours[:12], theirs[:12])
    assert ours[:8] == [  # a window of 2: the stepping micro-batch runs inside optimizer_step, as its closure
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "optimizer_step",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "configure_gradient_clipping",
    ], ours[:12]
    assert ours.count("lr_scheduler_step") == 2  # once per epoch
    # what a module's hook and a Lightning callback saw before each optimizer step, and a callback's epoch-end log
    for model in ("hooks", "callbacks"):
        ours, theirs = z.record(model, "32-true")["grad_norms"], z.record(model, "32-true", "lightning")["grad_norms"]
        assert len(ours) == 24 and ours == pytest.approx(theirs, rel=1e-6), model
    spread = z.record("callbacks", "32-true")["epochs"][-1]["loss_spread"]
    assert spread == pytest.approx(z.record("callbacks", "32-true", "lightning")["epochs"][0]["loss_spread"], rel=1e-6)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "horovod"])
def test_a_crash_mid_epoch_resumes_to_the_uninterrupted_result(strategy, zoo):
    z = zoo(strategy)
    for model in MODELS:
        resumed = z.record(model, "32-true", "resume")
        assert "error" not in resumed and resumed["crashed"], (model, resumed)
        if model == "lstm" and strategy != "single":
            # the hidden state the demo carries between batches is each rank's own; its on_save_checkpoint
            # puts rank 0's in the one checkpoint (as under Lightning), so rank 1 resumes with rank 0's
            continue
        diff = _max_diff(z.weights(model, "32-true"), z.weights(model, "32-true", "resume"))
        assert diff == 0.0, f"{strategy} {model}: resumed weights differ from the uninterrupted run's by {diff}"


@pytest.mark.timeout(900)
def test_logging_in_epoch_hooks_and_reductions_equal_lightning_then_hold_over_ranks(zoo):
    """The GLUE tutorial's on_validation_epoch_end metrics over two validation loaders, reduce_fx max/min/sum, the batch hooks', epoch hooks'
    and a rank_zero_only value: on one process the values of Lightning's own Trainer; on 2 ranks reduced over
    both (sync_dist), so what does not depend on how the samples are split equals the one-process value."""
    single = z = zoo("single")
    for precision in ("32-true", "bf16-mixed"):
        ours = z.record("glue", precision)["epochs"][-1]
        theirs = z.record("glue", precision, "lightning")["epochs"][0]  # Lightning's callback_metrics after fit
        assert set(theirs) == {
            "val_loss_matched", "accuracy_matched", "val_loss_mismatched", "accuracy_mismatched",
            "val_batches/dataloader_idx_0", "val_batches/dataloader_idx_1",  # two validation loaders
            "train_loss", "train_loss_max", "train_loss_min", "samples",
            "epoch_started", "epoch_ended", "label_mean", "rank0_only",
        }, sorted(theirs)  # fmt: skip
        assert {k: ours.get(k) for k in theirs} == pytest.approx(theirs, rel=1e-6), precision
    reference = single.record("glue", "32-true")["epochs"]
    for strategy in ("ddp", "fsdp"):
        z = zoo(strategy)
        for rank, results in enumerate(z.ranks):
            for epoch, (metrics, expected) in enumerate(zip(results["glue/32-true/unifit"]["epochs"], reference)):
                where = (strategy, rank, epoch)
                assert metrics["samples"] == 64.0, where  # a sum over both ranks
                assert metrics["val_batches/dataloader_idx_0"] == 6.0, where
                assert metrics["val_batches/dataloader_idx_1"] == 4.0, where
                assert metrics["epoch_started"] == epoch and metrics["epoch_ended"] == epoch + 0.5, where
                assert metrics["rank0_only"] == 8.0 * (epoch + 1), where  # rank 0's global_step, on every rank
                for split in ("matched", "mismatched"):  # 12 of 24 (8 of 16) samples on each rank: the mean of
                    # the two ranks' values is the value over all of them
                    accuracy = f"accuracy_{split}"
                    assert metrics[accuracy] == pytest.approx(expected[accuracy], rel=1e-12), where
                    val_loss = f"val_loss_{split}"
                    assert metrics[val_loss] == pytest.approx(expected[val_loss], rel=1e-5), where
                assert metrics["label_mean"] == pytest.approx(expected["label_mean"], rel=1e-12), where
                assert metrics["train_loss_max"] >= metrics["train_loss"] >= metrics["train_loss_min"], where


@pytest.mark.timeout(900)
def test_ddp_takes_the_steps_of_one_process_accumulating(zoo):
    single, ddp = zoo("single"), zoo("ddp")
    for model in MODELS:
        # per-batch statistics / a hidden state carried per rank / single trained without accumulating / drawn per world
        if model in BATCH_NORM or model == "lstm" or model in MANUAL or model in SAMPLED:
            continue
        one = _step_losses(single.record(model, "32-true"), 2)
        two = [
            (a + b) / 2
            for a, b in zip(
                ddp.record(model, "32-true", rank=0)["losses"], ddp.record(model, "32-true", rank=1)["losses"]
            )
        ]
        assert len(one) == len(two), model
        for step, (a, b) in enumerate(zip(one[:EARLY_STEPS], two[:EARLY_STEPS])):
            assert a == pytest.approx(b, abs=1e-4), f"{model}: step {step} loss {a} (single) vs {b} (ddp)"
        if model in STABLE:
            assert _max_diff(single.weights(model, "32-true"), ddp.weights(model, "32-true")) < 1e-4, model


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "smddp-like", "horovod"])
def test_lightning_callbacks_see_the_averaged_gradients_on_every_rank(strategy, zoo):
    """The gradient norm a Lightning callback computes before each optimizer step (from the sharded DTensors under
    fsdp) is the one-process norm of the same step, on every rank."""
    single, z = zoo("single"), zoo(strategy)
    reference = single.record("callbacks", "32-true")["grad_norms"]
    for rank in range(2):
        norms = z.record("callbacks", "32-true", rank=rank)["grad_norms"]
        assert norms == pytest.approx(reference, rel=1e-5), (strategy, rank)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["fsdp", "smddp-like", "horovod"])
def test_other_strategies_end_with_ddps_weights(strategy, zoo):
    ddp, other = zoo("ddp"), zoo(strategy)
    for model in MODELS:
        diff = _max_diff(ddp.weights(model, "32-true"), other.weights(model, "32-true"))
        assert diff < 1e-5, f"{strategy} {model}: weights differ from ddp's by {diff}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bf16_follows_full_precision(strategy, zoo):
    z = zoo(strategy)
    for model in MODELS:
        full, half = z.record(model, "32-true"), z.record(model, "bf16-mixed")
        # later: each its own path; soonest where fsdp gathers bfloat16 weights into BatchNorm over 4 samples a rank
        steps = 1 if strategy == "fsdp" and model in BATCH_NORM else 2
        for step, (a, b) in enumerate(zip(full["losses"][:steps], half["losses"][:steps])):
            assert b == pytest.approx(a, rel=0.05), f"{strategy} {model}: bf16 step {step} loss {b} vs {a}"


@pytest.mark.timeout(900)
def test_fsdp_refuses_an_in_place_op_on_a_units_view_output(zoo):
    """FSDP2 warns on every view a unit returns; unifit refuses only a step that modified one in place (its
    backward would skip gathering the unit's parameters), and trains the same module written out of place."""
    z = zoo("fsdp")
    for rank in range(2):
        error = z.record("view-inplace", "32-true", rank=rank).get("error", "")
        assert "ConfigError" in error and "was modified in place before backward" in error, error
        assert "out = out + y, not out += y" in error and "\n" not in error
        assert "error" not in z.record("view-copy", "32-true", rank=rank)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", list(LAUNCHES))
def test_a_users_weighted_sampler_rebalances_the_classes_on_every_strategy(strategy, zoo):
    """One sample in 8 is of class 1; the data module's WeightedRandomSampler draws them as often as the other class,
    under Lightning's own Trainer and under unifit on 1 or 2 ranks (each rank a disjoint share of the draws)."""
    z = zoo(strategy)
    kinds = ("unifit", "lightning") if strategy == "single" else ("unifit",)
    for kind in kinds:
        seen = [sum(z.record("imbalanced", "32-true", kind, rank)["classes_seen"][c] for rank in range(len(z.ranks)))
                for c in (0, 1)]  # fmt: skip
        assert sum(seen) == 192 and 0.35 < seen[1] / sum(seen) < 0.65, (strategy, kind, seen)  # unweighted: 0.125
