"""The PyTorch zoo, run by every process of one launch: each model, in each precision, trained by unifit
with the strategy the launch names (`unifit launch --strategy ddp -- tests/zoo/run_torch_zoo.py ...`),
one Trainer per run, all in this one process (one interpreter start for the whole zoo).

Per run it writes, per rank, what the tests compare: the loss of every micro-batch, the epoch metrics
and a digest of the whole model (rank 0 also saves the model's weights). With --resume it also trains
each model in 32-true with a checkpoint every few steps, crashes mid-epoch, resumes from the last
checkpoint and records the rest; with --lightning (one process) it trains the same models with
Lightning's own Trainer too: the reference.

    python tests/zoo/run_torch_zoo.py --out DIR --models boring,gpt2 --precisions 32-true,bf16-mixed
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.zoo

import unifit  # noqa: E402
from tests.zoo.recording import Crash, Recorder, SimulatedCrash, run_all  # noqa: E402
from tests.zoo.torch_models import GPU_MODELS, MANUAL, MODELS  # noqa: E402

EPOCHS = 2


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on every rank (FSDP's shards gathered: a collective, so every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu()
        for k, v in module.state_dict().items()
    }


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].numpy().tobytes())
    return h.hexdigest()


def build(name: str, batch: int, models: dict[str, Any]) -> tuple[Any, Any]:
    torch.manual_seed(0)  # the same initial weights and data in every run and on every rank
    return models[name][0](batch)


def unifit_run(
    name: str, precision: str, args: argparse.Namespace, models: dict[str, Any], root: Path, resume: bool = False
) -> dict[str, Any]:
    module, data = build(name, args.batch, models)
    recorder = Recorder()
    options: dict[str, Any] = dict(
        max_epochs=EPOCHS,
        precision=precision,
        accumulate_grad_batches=1 if name in MANUAL else args.accumulate,
        lr_scaling="none",
        root_dir=str(root),
        progress_bar=False,
        tensorboard={"enabled": False},
        checkpoint={"enabled": resume},
        nan_guard={"enabled": False},
        collective_timeout_s=60,
        callbacks=[recorder],
        strategy_options=json.loads(args.strategy_options),
    )
    crashed = None
    if resume:  # crash mid-epoch, then resume from the last checkpoint in a fresh Trainer and module
        try:
            unifit.Trainer(**{**options, "callbacks": [recorder, Crash()]}).fit(module, data)
        except SimulatedCrash as exc:
            crashed = str(exc)
        module, data = build(name, args.batch, models)
        recorder = Recorder()
        options["callbacks"] = [recorder]
        unifit.Trainer(**options).fit(module, data, ckpt_path="last")
    else:
        unifit.Trainer(**options).fit(module, data)
    state = full_state(module)
    return {
        "losses": recorder.losses,
        "epochs": recorder.epochs,
        "digest": digest(state),
        "weights": state,
        "crashed": crashed,
        "calls": getattr(module, "calls", None),  # the step hooks a module recorded (own_step_models.py)
        "grad_norms": getattr(module, "grad_norms", None),  # seen in on_before_optimizer_step (module or callback)
        "classes_seen": getattr(module, "classes_seen", None),  # what a user's sampler drew (own_step_models.py)
    }


def lightning_run(name: str, precision: str, args: argparse.Namespace, models: dict[str, Any]) -> dict[str, Any]:
    import lightning as L

    module, data = build(name, args.batch, models)
    trainer = L.Trainer(
        accelerator="gpu" if args.gpu else "cpu",
        devices=1,
        max_epochs=EPOCHS,
        precision=precision,
        accumulate_grad_batches=1 if name in MANUAL else args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)
    state = full_state(module)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {
        "losses": [],
        "epochs": [metrics],
        "digest": digest(state),
        "weights": state,
        "crashed": None,
        "calls": getattr(module, "calls", None),
        "grad_norms": getattr(module, "grad_norms", None),
        "classes_seen": getattr(module, "classes_seen", None),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--precisions", default="32-true,bf16-mixed,16-mixed")
    parser.add_argument("--batch", type=int, default=4, help="per rank, for the models whose data is ours")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--resume", action="store_true", help="also: crash mid-epoch and resume (32-true)")
    parser.add_argument("--lightning", action="store_true", help="also: Lightning's own Trainer (one process)")
    parser.add_argument("--strategy-options", default="{}", help="JSON, e.g. '{\"local_world_size\": 1}'")
    parser.add_argument("--checks", action="store_true", help="also: tests/zoo/view_module.py's two cases")
    parser.add_argument("--gpu", action="store_true", help="the GPU zoo (torchvision's resnet18 too)")
    args = parser.parse_args()
    models = GPU_MODELS if args.gpu else MODELS
    if args.checks:
        from tests.zoo.view_module import CHECKS

        models = {**models, **CHECKS}
    out = Path(args.out)
    rank = int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0")))
    runs = [(m, p, "unifit") for m in args.models.split(",") for p in args.precisions.split(",")]
    runs += [(m, "32-true", "resume") for m in args.models.split(",")] if args.resume else []
    runs += [(c, "32-true", "unifit") for c in ("view-inplace", "view-copy")] if args.checks else []
    runs += (
        [(m, p, "lightning") for m in args.models.split(",") for p in args.precisions.split(",") if p != "16-mixed"]
        if args.lightning
        else []
    )

    def run_one(name: str, precision: str, kind: str) -> dict[str, Any]:
        if kind == "lightning":
            return lightning_run(name, precision, args, models)
        return unifit_run(name, precision, args, models, out / "runs" / name / precision / kind, kind == "resume")

    def save(stem: str, state: Any) -> None:
        if rank == 0:
            torch.save(state, out / f"{stem}.pt")

    run_all(runs, run_one, save, out, rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
