"""The Keras zoo, run by every process of one launch (`unifit launch --strategy mwms -- tests/zoo/run_keras_zoo.py
...`, or plain python for single): each keras-io model, in each precision, trained by unifit from its compiled
model and batched tf.data pipeline, all in this one process (one TensorFlow start for the whole zoo).

Per run it writes, per rank, the loss of every step, the epoch metrics and a digest of the trained weights
(rank 0 also saves the weights). With --resume the text model also crashes mid-epoch and resumes from the last
checkpoint; with --reference (one process) Keras' own model.fit trains the same models: the reference.

    python tests/zoo/run_keras_zoo.py --out DIR --precisions 32-true,bf16-mixed --reference
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.zoo

import unifit  # noqa: E402
from tests.zoo.recording import Crash, Recorder, SimulatedCrash, run_all  # noqa: E402

EPOCHS = 2


def digest(weights: list[Any]) -> str:
    h = hashlib.sha256()
    for w in weights:
        h.update(w.astype("float32").tobytes())
    return h.hexdigest()


def process_rank() -> int:
    """This process's rank: Horovod's, else the worker index in TF_CONFIG (MultiWorkerMirroredStrategy), else 0."""
    if "HOROVOD_RANK" in os.environ:
        return int(os.environ["HOROVOD_RANK"])
    if "TF_CONFIG" in os.environ:
        return int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    return 0


def build(name: str, batch: int) -> tuple[Any, Any, Any]:
    from tests.zoo.keras_models import MODELS

    model, train, val, _ = MODELS[name](batch)
    return model, train, val


def page_callbacks(name: str, folder: Path) -> list[Any]:
    """The Keras callbacks the model's page passes to model.fit (its checkpoint file in `folder`)."""
    from tests.zoo.keras_models import CALLBACKS

    folder.mkdir(parents=True, exist_ok=True)
    return CALLBACKS[name](str(folder)) if name in CALLBACKS else []


def callback_record(callbacks: list[Any], folder: Path, model: Any) -> dict[str, Any]:
    """What the page's callbacks left: EarlyStopping's stopped_epoch, a digest of ModelCheckpoint's file."""
    record: dict[str, Any] = {}
    for callback in callbacks:
        if hasattr(callback, "stopped_epoch"):
            record["stopped_epoch"] = int(callback.stopped_epoch)
    checkpoint = folder / "model_checkpoint.weights.h5"
    if checkpoint.exists():
        import keras

        saved = keras.models.clone_model(model)
        saved.load_weights(str(checkpoint))
        record["checkpoint_digest"] = digest(saved.get_weights())
    return record


def epochs_of(name: str) -> int:
    return 3 if name == "weather" else EPOCHS  # the weather page's early stopping gets a chance to stop


def unifit_run(name: str, precision: str, args: argparse.Namespace, root: Path, resume: bool) -> dict[str, Any]:
    model, train, val = build(name, args.batch)
    recorder = Recorder()
    callbacks = page_callbacks(name, root / "page")
    options: dict[str, Any] = dict(
        max_epochs=epochs_of(name),
        precision=precision,
        lr_scaling="none",
        root_dir=str(root),
        progress_bar=False,
        tensorboard={"enabled": False},
        checkpoint={"enabled": resume},
        nan_guard={"enabled": False},
        collective_timeout_s=60,
        strategy_options=json.loads(args.strategy_options),
        callbacks=[recorder, *callbacks],
    )
    crashed = None
    if resume:
        try:
            unifit.Trainer(**{**options, "callbacks": [recorder, Crash()]}).fit(
                model, data={"train": train, "val": val}
            )
        except SimulatedCrash as exc:
            crashed = str(exc)
        model, train, val = build(name, args.batch)
        recorder = Recorder()
        options["callbacks"] = [recorder]
        unifit.Trainer(**options).fit(model, data={"train": train, "val": val}, ckpt_path="last")
    else:
        unifit.Trainer(**options).fit(model, data={"train": train, "val": val})
    weights = model.get_weights()
    return {
        "losses": recorder.losses,
        "epochs": recorder.epochs,
        "digest": digest(weights),
        "weights": weights,
        "crashed": crashed,
        **callback_record(callbacks, root / "page", model),
    }


def keras_run(name: str, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    """Keras' own model.fit on the same compiled model and pipeline (its precision: the global policy)."""
    import keras

    policy = {"32-true": "float32", "bf16-mixed": "mixed_bfloat16", "16-mixed": "mixed_float16"}[precision]
    keras.mixed_precision.set_global_policy(policy)
    folder = Path(args.out) / "keras-page" / name / precision
    try:
        model, train, val = build(name, args.batch)
        callbacks = page_callbacks(name, folder)
        history = model.fit(train, validation_data=val, epochs=epochs_of(name), verbose=0, callbacks=callbacks)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    weights = model.get_weights()
    return {
        "losses": [],
        "epochs": [{k: float(v[-1]) for k, v in history.history.items()}],
        "digest": digest(weights),
        "weights": weights,
        "crashed": None,
        **callback_record(callbacks, folder, model),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="image,image-plain,text")
    parser.add_argument("--precisions", default="32-true,bf16-mixed")
    parser.add_argument("--batch", type=int, default=16, help="per replica")
    parser.add_argument("--resume", action="store_true", help="also: the text model crashes mid-epoch, resumes")
    parser.add_argument("--reference", action="store_true", help="also: Keras' own model.fit (one process)")
    parser.add_argument("--strategy-options", default="{}", help="JSON, e.g. '{\"devices\": 2}'")
    args = parser.parse_args()
    # as unifit's advice says: a Trainer first, so mirrored claims its logical devices before TensorFlow starts
    unifit.Trainer(strategy_options=json.loads(args.strategy_options))
    import numpy as np

    out = Path(args.out)
    rank = process_rank()
    models, precisions = args.models.split(","), args.precisions.split(",")
    runs = [(m, p if m != "weather" else "32-true", "unifit") for m in models for p in precisions]
    runs = list(dict.fromkeys(runs))  # the weather page's model and callbacks: in 32-true only
    runs += [("text", "32-true", "resume")] if args.resume and "text" in models else []
    runs += (
        list(dict.fromkeys((m, p if m != "weather" else "32-true", "keras") for m in models for p in precisions))
        if args.reference
        else []
    )

    def run_one(name: str, precision: str, kind: str) -> dict[str, Any]:
        if kind == "keras":
            return keras_run(name, precision, args)
        return unifit_run(name, precision, args, out / "runs" / name / precision / kind, kind == "resume")

    def save(stem: str, weights: list[Any]) -> None:
        np.savez(out / f"{stem}{f'.rank{rank}' if rank else ''}.npz", *weights)

    run_all(runs, run_one, save, out, rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
