"""Run TensorFlow's MirroredStrategy tutorial and its unifit port in one fresh process, on 2 logical CPU devices.

TensorFlow fixes its devices when it starts, so this process splits the CPU first (what a 2-GPU machine has),
and the tutorial's `tf.distribute.MirroredStrategy()` (every local GPU) is given those 2 devices. Each script
runs in its own directory from the same seed; what they produced is written as JSON to argv[1].
Used by tests/test_migrating.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import sys
from pathlib import Path

import tensorflow as tf

HERE = Path(__file__).resolve().parent
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


@contextlib.contextmanager
def two_cpu_devices_for_mirrored_strategy():
    """The tutorial's `tf.distribute.MirroredStrategy()` (every local GPU) on this process's 2 CPU devices."""
    real = tf.distribute.MirroredStrategy
    tf.distribute.MirroredStrategy = lambda: real(["/cpu:0", "/cpu:1"])
    try:
        yield
    finally:
        tf.distribute.MirroredStrategy = real


def run(script: str, workdir: Path) -> dict:
    import keras

    workdir.mkdir(parents=True)
    os.chdir(workdir)
    keras.utils.set_random_seed(0)
    printed = io.StringIO()
    devices = two_cpu_devices_for_mirrored_strategy() if "unifit" not in script else contextlib.nullcontext()
    with contextlib.redirect_stdout(printed), devices:
        names = runpy.run_path(str(HERE / script), run_name="__main__")
    metrics = workdir / "runs" / "default" / "metrics.jsonl"
    if metrics.exists():  # the port: what unifit trained with, per epoch
        epochs = [json.loads(line) for line in metrics.read_text().splitlines() if line]
        lrs, losses = [m["lr"] for m in epochs], [m["train/loss"] for m in epochs]
    else:  # the original: its PrintLR callback's lines and model.fit's History
        lrs = [float(v) for v in re.findall(r"Learning rate for epoch \d+ is ([\d.e-]+)", printed.getvalue())]
        losses = names["model"].history.history["loss"]
    return {
        "lrs": lrs,
        "train_loss": losses,
        "eval": [names["eval_loss"], names["eval_acc"]],
        "checkpoints": sorted(p.name for p in (workdir / "training_checkpoints").iterdir()),
    }


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    out = Path(sys.argv[1])
    results = {
        kind: run(script, out.parent / kind)
        for kind, script in (
            ("original", "tf_keras_mirrored_tutorial.py"),
            ("port", "tf_keras_mirrored_tutorial_unifit.py"),
        )
    }
    out.write_text(json.dumps(results))
