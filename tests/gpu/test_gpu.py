"""GPU paths: CUDA devices, NCCL, mixed precision, resume. Skipped with the reason where CUDA is absent;
run for real on a GPU machine (the last runs: benchmarks/results/gpu_tests*.log)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_ok, metrics_lines, run_unifit
from tests.zoo.own_step_models import SAMPLED

if not torch.cuda.is_available():
    reason = "no CUDA device visible to torch: the GPU tests run only on a GPU machine"
    print(f"tests/gpu skipped: {reason}")
    pytest.skip(reason, allow_module_level=True)

GPU_YAML = Path(__file__).with_name("gpu_probe.yaml")
GPUS = torch.cuda.device_count()
pytestmark = pytest.mark.timeout(300)


def _run(root: Path, *args: str, procs: int | None = None, strategy: str = "single", ckpt: str | None = None):
    report = {"class_path": "tests.gpu.gpu_probe.GpuReport", "init_args": {"out_dir": str(root / "reports")}}
    head = ["fit"] if procs is None else ["launch", "--nproc-per-node", str(procs)]
    cmd = [
        *head,
        "-c",
        str(GPU_YAML),
        "--trainer.root_dir",
        str(root),
        "--trainer.strategy",
        strategy,
        "--trainer.callbacks",
        json.dumps([report]),
        *args,
    ]
    return run_unifit(*cmd, *(["--ckpt-path", ckpt] if ckpt else []), timeout=240)


def _reports(root: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted((root / "reports").glob("report_*.json"))]


@pytest.mark.parametrize(
    "precision,dtype", [("32-true", "torch.float32"), ("bf16-mixed", "torch.bfloat16"), ("16-mixed", "torch.float16")]
)
def test_single_gpu_trains_on_cuda_in_each_precision(tmp_path, precision, dtype):
    result = _run(tmp_path, "--trainer.precision", precision)
    assert_ok(result)
    (report,) = _reports(tmp_path)
    assert report["param_device"] == "cuda:0" and report["batch_device"] == "cuda:0"
    assert report["logits_dtype"] == dtype
    assert report["metrics"]["val/acc"] > 0.5, report["metrics"]  # the task is learnable; chance is 0.1
    if precision == "16-mixed":  # the GradScaler's state is part of the checkpoint
        state = _last_state(tmp_path)
        assert state["engine"]["precision"]["scaler"]["scale"] > 0


def _last_state(root: Path) -> dict:
    pointer = json.loads((root / "checkpoints" / "last.json").read_text())
    return torch.load(root / "checkpoints" / pointer["name"] / "state.pt", weights_only=True)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_ddp_nccl_world_one_runs_nccl_collectives(tmp_path, precision):
    """torchrun with one process: a real NCCL group, DDP wrapper and metric reductions on CUDA."""
    result = _run(tmp_path, "--trainer.precision", precision, procs=1, strategy="ddp")
    assert_ok(result)
    (report,) = _reports(tmp_path)
    assert report["backend"] == "nccl" and report["param_device"] == "cuda:0"
    assert report["metrics"]["val/acc"] > 0.5
    assert [m["epoch"] for m in metrics_lines(tmp_path) if "val/acc" in m] == [1, 2, 3, 4]


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_resume_on_gpu_matches_uninterrupted_run(tmp_path, precision):
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert_ok(_run(whole, "--trainer.precision", precision))
    assert_ok(_run(part, "--trainer.precision", precision, "--trainer.max_epochs", "2"))
    assert_ok(_run(part, "--trainer.precision", precision, ckpt="last"))
    losses = [[m["train/loss"] for m in metrics_lines(root) if "train/loss" in m] for root in (whole, part)]
    assert len(losses[1]) == 4  # two epochs, then two more after the resume
    assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-5)
    (a,), (b,) = _reports(whole), _reports(part)
    # cuDNN's convolution backward is not bit-deterministic run to run: weights agree to ~1e-4 relative
    assert b["weights_sum"] == pytest.approx(a["weights_sum"], rel=2e-3)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_nan_loss_on_gpu_stops_before_a_bad_checkpoint(tmp_path, precision):
    """The guard reads the GPU's flag without stalling it; a NaN loss still stops the run (a float16 step
    the GradScaler skips for inf gradients does not)."""
    result = _run(
        tmp_path,
        "--trainer.precision",
        precision,
        "--module.init_args.nan_at_step",
        "20",
        "--trainer.nan_guard.check_every_n_steps",
        "4",
    )
    assert result.returncode == 1, result.stderr
    assert "training stopped on all ranks: non-finite loss at step 20 on rank 0" in result.stderr, result.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch=0001-step=0000016", "last.json"]


@pytest.mark.skipif(GPUS >= 2, reason="needs a machine with exactly one GPU")
def test_two_processes_on_one_gpu_is_a_one_line_error(tmp_path):
    result = _run(tmp_path, procs=2, strategy="ddp")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "has no GPU" in line]
    assert lines and "--nproc-per-node" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "smddp-like", "fsdp"])
def test_two_gpus_nccl_identical_weights(tmp_path, strategy):
    result = _run(tmp_path, "--trainer.precision", "bf16-mixed", procs=2, strategy=strategy)
    assert_ok(result)
    reports = _reports(tmp_path)
    assert {r["param_device"] for r in reports} == {"cuda:0", "cuda:1"}
    assert reports[0]["weights_sum"] == reports[1]["weights_sum"]
    assert reports[0]["metrics"] == reports[1]["metrics"]


@pytest.mark.parametrize("precision, offload", [("32-true", False), ("bf16-mixed", False), ("bf16-mixed", True)])
def test_fsdp_nccl_trains_and_resumes_on_gpu(tmp_path, precision, offload):
    """fsdp under torchrun with one process: NCCL, FSDP2's bf16 parameters with float32 reduction, CPU
    offload of the sharded state, DCP checkpoints written from the GPU and resumed."""
    args = ["--trainer.precision", precision, "--trainer.strategy_options", f"{{cpu_offload: {str(offload).lower()}}}"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert_ok(_run(whole, *args, procs=1, strategy="fsdp"))
    (report,) = _reports(whole)
    assert report["backend"] == "nccl"
    assert report["metrics"]["val/acc"] > 0.5, report["metrics"]
    assert (whole / "checkpoints" / "epoch=0004-step=0000064" / "shards" / ".metadata").is_file()
    assert_ok(_run(part, *args, "--trainer.max_epochs", "2", procs=1, strategy="fsdp"))
    assert_ok(_run(part, *args, procs=1, strategy="fsdp", ckpt="last"))
    losses = [[m["train/loss"] for m in metrics_lines(root) if "train/loss" in m] for root in (whole, part)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-3, abs=1e-4)


def _zoo(out: Path, strategy: str, *args: str):
    driver = ["tests/zoo/run_torch_zoo.py", "--gpu", "--out", str(out), *args]
    return run_unifit("launch", "--nproc-per-node", "1", "--strategy", strategy, "--", *driver, timeout=280)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "smddp-like"])
def test_model_zoo_on_one_gpu(tmp_path, strategy):
    """The zoo (Lightning's demos, GPT-2, BERT, ResNet-18s incl. torchvision's) on CUDA in every precision the
    strategy takes, with a mid-epoch crash and resume; under single also Lightning's own Trainer on the GPU
    (equal weights within GPU kernels' nondeterminism). The GPU check of docs/zoo.md:
    `pytest tests/gpu -k zoo` (writes benchmarks/results/gpu_zoo_<strategy>.json)."""
    pytest.importorskip("transformers")
    import torch

    precisions = "32-true,bf16-mixed" if strategy == "fsdp" else "32-true,bf16-mixed,16-mixed"
    extra = ["--lightning", "--resume"] if strategy == "single" else ["--resume"]
    assert_ok(_zoo(tmp_path, strategy, "--precisions", precisions, *extra))
    results = json.loads((tmp_path / "rank0.json").read_text())
    failed = {key: r["error"] for key, r in results.items() if "error" in r}
    summary = {
        "command": f"pytest tests/gpu -k 'zoo and {strategy}'",
        "device": torch.cuda.get_device_name(0),
        "runs": {
            key: {"error": r.get("error"), "final_loss": (r.get("losses") or [None])[-1]} for key, r in results.items()
        },
    }
    out = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / f"gpu_zoo_{strategy}.json"
    out.write_text(json.dumps(summary, indent=1))  # committed after a GPU run: what ran, what was refused
    assert not failed, failed
    for key, record in results.items():
        model, precision, kind = key.split("/")
        if kind == "lightning" and model not in SAMPLED:  # a user's sampler draws from another RNG under Lightning
            ours = torch.load(tmp_path / f"{model}.{precision}.unifit.pt")
            theirs = torch.load(tmp_path / f"{model}.{precision}.lightning.pt")
            diff = max((ours[k] - theirs[k]).abs().max().item() for k in ours if ours[k].is_floating_point())
            assert diff < (1e-3 if precision == "32-true" else 5e-2), (key, diff)
        if kind == "resume":
            assert record["crashed"], key


HOST_SYNC_YAML = Path(__file__).parents[1] / "probe" / "host_sync.yaml"


@pytest.mark.parametrize(
    "strategy, precision, on_device",
    [("single", "32-true", "true"), ("single", "bf16-mixed", "false"), ("ddp", "bf16-mixed", "auto")],
)
def test_steady_state_steps_never_sync_the_gpu(tmp_path, strategy, precision, on_device):
    """tests/test_host_sync.py's window, on CUDA and under set_sync_debug_mode("error"): any synchronisation the
    CUDA runtime sees in those steps (whoever makes it) raises and fails the run. Data on the device (gathered
    there) and in host memory (copied ahead on a side stream) both."""
    counter = {
        "class_path": "tests.probe.host_sync.HostSyncCounter",
        "init_args": {"out_dir": str(tmp_path), "cuda_error_mode": True},
    }
    result = run_unifit(
        "launch", "--nproc-per-node", "1", "-c", str(HOST_SYNC_YAML), "--trainer.strategy", strategy,
        "--trainer.root_dir", str(tmp_path / "run"), "--trainer.precision", precision,
        "--trainer.accelerator", "gpu", "--trainer.data_on_device", on_device,
        "--trainer.callbacks", json.dumps([counter]), timeout=240,
    )  # fmt: skip
    assert_ok(result)
    report = json.loads((tmp_path / "host_sync_0.json").read_text())
    assert report["steps"] == 8 and report["calls"] == {}, report
    placed = "placed on cuda:0" in result.stdout + result.stderr
    assert placed == (on_device != "false"), result.stdout[-2000:]  # auto: a few KB fit


def test_data_on_the_device_or_copied_ahead_trains_the_same_and_resumes_mid_epoch(tmp_path):
    """The same loss curve whether batches are gathered on the GPU or copied ahead from host memory; a
    mid-epoch checkpoint taken while a batch was already copied ahead resumes without losing or repeating it."""
    steps = ["--trainer.checkpoint.every_n_steps", "6", "--trainer.checkpoint.keep_last_n", "null"]
    curves = {}
    for on_device in ("true", "false"):
        root = tmp_path / on_device
        assert_ok(_run(root, "--trainer.data_on_device", on_device, *steps))
        curves[on_device] = [m["train/loss"] for m in metrics_lines(root) if "train/loss" in m]
    assert curves["true"] == pytest.approx(curves["false"], rel=1e-4, abs=1e-5)
    # step 18 is 2 batches into epoch 2 (16 a epoch), saved while batch 19 was already copied ahead; (max_steps
    # would end its epoch early, by design, so the copy-ahead run's own step checkpoint is resumed)
    mid_epoch = tmp_path / "false" / "checkpoints" / "epoch=0001-step=0000018"
    resumed_root = tmp_path / "resumed"
    assert_ok(_run(resumed_root, "--trainer.data_on_device", "false", *steps, ckpt=str(mid_epoch)))
    resumed = [m["train/loss"] for m in metrics_lines(resumed_root) if "train/loss" in m]
    assert len(resumed) == 3  # epochs 2 (its 14 remaining steps, its first 2 in the saved sums), 3 and 4
    assert resumed == pytest.approx(curves["false"][-3:], rel=1e-4, abs=1e-5)


SHARED = {
    "ddp": "{share_gpus: true}",
    "smddp-like": "{share_gpus: true, local_world_size: 1}",
    "fsdp": "{share_gpus: true}",
}


@pytest.mark.parametrize("strategy", SHARED)
def test_two_ranks_sharing_one_gpu_agree_and_resume(tmp_path, strategy):
    """The multi-rank CUDA paths on a one-GPU machine: 2 ranks on cuda:0 over gloo (which takes CUDA tensors)
    with bf16-mixed: identical replicas and metrics, smddp-like's hierarchy over 2 "nodes", fsdp's sharded
    checkpoint written from the GPU and resumed to the same curve."""
    # the global batch doubles: half the single run's lr (scaled back by the world size) and twice its epochs
    args = ["--trainer.precision", "bf16-mixed", "--trainer.strategy_options", SHARED[strategy]]
    args += ["--module.init_args.lr", "0.025", "--trainer.max_epochs", "8"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert_ok(_run(whole, *args, procs=2, strategy=strategy))
    reports = _reports(whole)
    assert [r["param_device"] for r in reports] == ["cuda:0", "cuda:0"] and reports[0]["backend"] == "gloo"
    assert reports[0]["weights_sum"] == reports[1]["weights_sum"]
    metrics = [{k: v for k, v in r["metrics"].items() if not k.startswith("throughput/")} for r in reports]
    assert metrics[0] == metrics[1]  # reduced over the ranks (each rank's own throughput aside)
    assert metrics[0]["val/loss"] < 1.5 and metrics[0]["val/acc"] > 0.3, metrics[0]  # learnt: chance is 2.30, 0.1
    if strategy != "fsdp":
        return
    assert_ok(_run(part, *args, "--trainer.max_epochs", "2", procs=2, strategy=strategy))
    assert_ok(_run(part, *args, procs=2, strategy=strategy, ckpt="last"))
    losses = [[m["train/loss"] for m in metrics_lines(root) if "train/loss" in m] for root in (whole, part)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-3, abs=1e-4)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs (tensor parallel cannot share one GPU: see share_gpus)")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_tensor_parallel_on_two_gpus_matches_one_gpu(tmp_path, precision):
    """model-parallel's CUDA path: TP2 (the plan of tests/probe/tiny_gpt.py) on 2 GPUs over nccl against one
    process on one GPU, same global batch. Two ranks sharing one GPU (gloo) cannot run it: DTensor's collectives
    over gloo on CUDA tensors segfault (H100, torch 2.11; tests/probe/gloo_cuda_collectives.py), so unifit
    refuses share_gpus with tensor_parallel."""
    from tests.probe.tiny_gpt import PLAN
    from tests.test_model_parallel import YAML

    def run(root: Path, *args: str) -> None:
        common = ["-c", str(YAML), "--trainer.root_dir", str(root), "--trainer.export_dir", str(root / "export")]
        assert_ok(
            run_unifit(*args, *common, "--trainer.precision", precision, "--trainer.accelerator", "gpu", timeout=240)
        )

    run(tmp_path / "one", "fit")
    options = json.dumps({"tensor_parallel": 2, "plan": PLAN})
    run(tmp_path / "tp2", "launch", "--nproc-per-node", "2", "--trainer.strategy", "model-parallel",
        "--trainer.strategy_options", options)  # fmt: skip
    weights = [torch.load(tmp_path / r / "export" / "model.pt", weights_only=True) for r in ("one", "tp2")]
    worst = max((weights[0][k].float() - weights[1][k].float()).abs().max().item() for k in weights[0])
    assert worst < (2e-2 if precision == "bf16-mixed" else 1e-4), worst
    for mine, theirs in zip(metrics_lines(tmp_path / "tp2"), metrics_lines(tmp_path / "one")):
        assert mine["samples_seen"] == 64.0
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], abs=1e-2 if precision == "bf16-mixed" else 1e-4)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs (pipeline stages cannot share one GPU: see share_gpus)")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_pipeline_stages_on_gpus_match_one_gpu(tmp_path, precision):
    """model-parallel's pipeline on CUDA: 2 stages (tests/probe/tiny_gpt.py, its embedding tied to the head across
    the stages) over nccl on 2 GPUs, against one process on one GPU, same global batch. Two ranks sharing one GPU
    cannot run it: gloo's point-to-point sends of CUDA tensors fail ('writev: Bad address', H100, torch 2.11;
    benchmarks/results/archive/gpu_tests_pipeline_h100.log), so unifit refuses share_gpus with pipeline_parallel."""
    from tests.test_model_parallel import YAML

    def run(root: Path, *args: str) -> None:
        common = ["-c", str(YAML), "--trainer.root_dir", str(root), "--trainer.export_dir", str(root / "export")]
        common += ["--module.init_args.tied", "true", "--trainer.precision", precision, "--trainer.accelerator", "gpu"]
        assert_ok(run_unifit(*args, *common, timeout=240))

    run(tmp_path / "one", "fit")
    options = json.dumps({"pipeline_parallel": 2, "microbatches": 4})
    run(tmp_path / "pp2", "launch", "--nproc-per-node", "2", "--trainer.strategy", "model-parallel",
        "--trainer.strategy_options", options)  # fmt: skip
    weights = [torch.load(tmp_path / r / "export" / "model.pt", weights_only=True) for r in ("one", "pp2")]
    worst = max((weights[0][k].float() - weights[1][k].float()).abs().max().item() for k in weights[0])
    assert worst < (2e-2 if precision == "bf16-mixed" else 1e-4), worst
    for mine, theirs in zip(metrics_lines(tmp_path / "pp2"), metrics_lines(tmp_path / "one"), strict=True):
        assert mine["samples_seen"] == 64.0
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], abs=1e-2 if precision == "bf16-mixed" else 1e-4)


class _Wide(torch.nn.Module):
    """Activations of 16 MB per sample (a 4M-wide hidden layer, kept for backward, with its gradient): a few
    thousand samples fill any GPU, so the batch size finder meets a real CUDA out-of-memory error."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 1 << 22), torch.nn.Linear(1 << 22, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_batch_size_finder_meets_a_real_out_of_memory_and_trains_at_what_fits(tmp_path, mode, caplog, request):
    """trainer.batch_size_find on the GPU: trials double the batch until CUDA runs out of memory (a thousand or
    two samples here), the memory of the failed trial is given back, and the fit trains at the size found."""
    import logging

    import unifit

    class WideRegressor(unifit.TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Wide()

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataset(self):
            g = torch.Generator().manual_seed(0)
            return torch.utils.data.TensorDataset(torch.randn(8192, 8, generator=g), torch.randn(8192, 1, generator=g))

    caplog.set_level(logging.INFO, logger="unifit")
    # at most 16 GiB of the GPU for this process: the tests beside it (pytest -n 8) keep the rest
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, 16 * 1024**3 / torch.cuda.get_device_properties(0).total_memory)
    )
    request.addfinalizer(lambda: torch.cuda.set_per_process_memory_fraction(1.0))
    module = WideRegressor()
    options = dict(max_epochs=1, limit_train_batches=2, progress_bar=False, root_dir=str(tmp_path), lr_scaling="none")
    state = unifit.Trainer(accelerator="gpu", batch_size_find={"mode": mode}, **options).fit(module)
    assert "ran out of memory" in caplog.text, caplog.text[-2000:]
    found = state.progress.global_batch
    assert 256 <= found < 8192 and state.global_step == 2, found
    assert torch.cuda.memory_allocated() < 2 * 1024**3  # the trials' activations are gone
