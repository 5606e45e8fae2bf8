"""tf.data pipelines under the Keras engine (frameworks/keras/data.py LazyData): read lazily, sharded per
worker (by file or by element), re-read every epoch (random augmentation differs), sample weights, uneven
last batches. The metric "y" is the mean of the labels a phase saw, so a sample missed or counted twice
changes it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import unifit
from tests.helpers import STRATEGY_OPTIONS, STRATEGY_PROCS, assert_ok, metrics_lines, run_unifit, strategy_name
from unifit.errors import ConfigError

pytestmark = pytest.mark.tf

TRAIN_FILES, VAL_FILES = (7, 5, 4), (5, 4)  # records per file: uneven parts under 2 workers


def _xy(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 1)).astype(np.float32)
    return x, (x[:, 0] * 2.0 + rng.standard_normal(n)).astype(np.float32)


def write_records(folder: Path, prefix: str, sizes: tuple[int, ...], seed: int) -> np.ndarray:
    """TFRecord files of serialized [x, y] pairs; returns every y."""
    import tensorflow as tf

    folder.mkdir(parents=True, exist_ok=True)
    x, y = _xy(sum(sizes), seed)
    start = 0
    for i, size in enumerate(sizes):
        with tf.io.TFRecordWriter(str(folder / f"{prefix}-{i}.tfrecord")) as writer:
            for j in range(start, start + size):
                writer.write(tf.io.serialize_tensor(tf.constant([x[j, 0], y[j]])).numpy())
        start += size
    return y


class PipelineModule(unifit.KerasModule):
    """y ~ Dense(1)(x). Data: TFRecord files (`folder`) or in-memory arrays; `noise` adds
    uniform noise to y inside the training pipeline (random augmentation)."""

    def __init__(
        self, folder: str | None = None, n: int = 24, noise: float = 0.0, lr: float = 0.0, filtered: bool = False
    ) -> None:
        super().__init__()
        self.folder, self.n, self.noise, self.lr, self.filtered = folder, n, noise, lr, filtered

    def build_model(self):
        import keras

        return keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")])

    def configure_optimizers(self):
        import keras

        return keras.optimizers.SGD(self.lr)

    def loss(self, y, y_pred):
        return (y - y_pred[:, 0]) ** 2

    def metrics(self, y, y_pred):
        return {"y": y}

    def _pipeline(self, prefix: str, seed: int):
        import tensorflow as tf

        if self.folder is None:
            data = tf.data.Dataset.from_tensor_slices(_xy(self.n, seed))
        else:
            files = tf.data.Dataset.list_files(f"{self.folder}/{prefix}-*.tfrecord", shuffle=False)
            data = tf.data.TFRecordDataset(files).map(lambda s: tf.ensure_shape(tf.io.parse_tensor(s, tf.float32), [2]))
            data = data.map(lambda xy: (xy[:1], xy[1]))
        if self.filtered:  # unknown cardinality: counted
            data = data.filter(lambda x, y: y > -1e9)
        return data

    def train_dataset(self):
        import tensorflow as tf

        data = self._pipeline("train", seed=1)
        if self.noise:
            data = data.map(lambda x, y: (x, y + tf.random.uniform((), 0.0, self.noise)))
        return data

    def val_dataset(self):
        return self._pipeline("val", seed=2)


def _fit(module, root, **options):
    options = {"max_epochs": 3, "batch_size": 4, "seed": 0, "progress_bar": False, **options}
    trainer = unifit.Trainer(root_dir=str(root), **options)
    trainer.fit(module)  # returns model.fit's History; the fit's state:
    return trainer.state


def _epoch_values(root, name):
    return [line[name] for line in metrics_lines(root) if name in line]


@pytest.mark.timeout(120)
def test_random_augmentation_differs_between_epochs(tmp_path):
    y = _xy(24, seed=1)[1]
    _fit(PipelineModule(), tmp_path / "plain")  # 24 samples, batch 4: every sample once per epoch
    plain = _epoch_values(tmp_path / "plain", "train/y")
    assert plain == pytest.approx([float(y.mean())] * 3, abs=1e-6)
    _fit(PipelineModule(noise=1.0), tmp_path / "noisy")
    noisy = _epoch_values(tmp_path / "noisy", "train/y")
    shift = np.asarray(noisy) - y.mean()  # each epoch's mean noise, in (0, 1)
    assert np.all((shift > 0.05) & (shift < 0.95)), shift
    assert len({round(v, 6) for v in noisy}) == 3, noisy  # drawn anew every epoch
    _fit(PipelineModule(noise=1.0), tmp_path / "again")  # and reproducibly with the same seed
    assert _epoch_values(tmp_path / "again", "train/y") == pytest.approx(noisy, abs=1e-6)


@pytest.mark.timeout(120)
def test_pipeline_is_read_lazily_and_counted_when_its_length_is_unknown(tmp_path):
    import tensorflow as tf

    read = []

    def endless_source():
        for i in range(10**6):
            read.append(i)
            yield np.float32([i % 7]), np.float32(i % 5)

    spec = (tf.TensorSpec((1,), tf.float32), tf.TensorSpec((), tf.float32))
    big = tf.data.Dataset.from_generator(endless_source, output_signature=spec)
    big = big.apply(tf.data.experimental.assert_cardinality(10**6))

    class Big(PipelineModule):
        def train_dataset(self):
            return big

        def val_dataset(self):
            return None

    state = _fit(Big(), tmp_path / "big", max_epochs=1, limit_train_batches=2)
    assert state.global_step == 2 and len(read) < 1000, len(read)  # not read into memory
    read.clear()  # Trainer.validate reads lazily too

    class BigVal(PipelineModule):
        def val_dataset(self):
            return big

    validated = unifit.Trainer(
        root_dir=str(tmp_path / "v"), batch_size=4, limit_val_batches=3, progress_bar=False
    ).validate(BigVal())
    assert validated["val/y"] == pytest.approx(np.mean(np.arange(12) % 5), abs=1e-6) and len(read) < 1000, len(read)
    # filter(): cardinality unknown, counted once: 24 samples, 6 batches of 4, every sample once
    _fit(PipelineModule(filtered=True), tmp_path / "filtered", max_epochs=1)
    lines = metrics_lines(tmp_path / "filtered")
    assert lines[-1]["train/y"] == pytest.approx(float(_xy(24, 1)[1].mean()), abs=1e-6)
    assert lines[-1]["val/y"] == pytest.approx(float(_xy(24, 2)[1].mean()), abs=1e-6)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("form", ["arrays", "dataset"])
def test_sample_weights_weigh_the_loss(tmp_path, form):
    """Weights 2 on the first half and 0 on the second train exactly as the first half alone does (full
    batch), and as Keras' own model.fit(sample_weight=...)."""
    import tensorflow as tf

    from tests.probe.keras_compiled_probe import arrays, compiled_model

    x, y = arrays(32, seed=1)
    w = np.r_[np.full(16, 2.0), np.zeros(16)].astype(np.float32)
    options = {"max_epochs": 3, "seed": 0, "progress_bar": False, "lr_scaling": "none"}
    weighted = compiled_model()
    data = (x, y, w) if form == "arrays" else tf.data.Dataset.from_tensor_slices((x, y, w))
    trainer = unifit.Trainer(batch_size=32, root_dir=str(tmp_path / "w"), **options)
    trainer.fit(weighted, data={"train": data, "val": (x, y, w)})
    state = trainer.state
    half = compiled_model()
    unifit.Trainer(batch_size=16, root_dir=str(tmp_path / "h"), **options).fit(half, data=(x[:16], y[:16]))
    reference = compiled_model()
    reference.fit(x, y, sample_weight=w, batch_size=32, epochs=3, shuffle=False, verbose=0)
    for a, b, c in zip(weighted.get_weights(), half.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
        np.testing.assert_allclose(a, c, atol=1e-6, rtol=0)
    unweighted = compiled_model()
    unifit.Trainer(batch_size=32, root_dir=str(tmp_path / "u"), **options).fit(unweighted, data=(x, y))
    assert max(np.abs(a - b).max() for a, b in zip(weighted.get_weights(), unweighted.get_weights())) > 1e-3
    import keras

    bad = compiled_model()
    bad.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
    with pytest.raises(ConfigError, match="reduction='mean_with_sample_weight'.*use reduction='sum_over_batch_size'"):
        unifit.Trainer(batch_size=32, root_dir=str(tmp_path / "b"), **options).fit(bad, data=(x, y, w))
    # the validation loss is weighted too, as Keras' evaluate(sample_weight=...)
    evaluated = reference.evaluate(x, y, sample_weight=w, verbose=0, return_dict=True)
    assert state.metrics["val/loss"] == pytest.approx(evaluated["loss"], abs=1e-5)


def test_bad_pipelines_are_refused_in_one_line(tmp_path):
    import tensorflow as tf

    x, y = _xy(8, seed=0)
    cases = [
        (tf.data.Dataset.from_tensor_slices((x, y)).repeat(), "endless", "remove .repeat()"),
        (
            tf.data.Dataset.from_generator(
                lambda: iter([(x, y)]),
                output_signature=(tf.TensorSpec((None, 1), tf.float32), tf.TensorSpec((None,), tf.float32)),
            ),
            "looks batched",
            "unbatch()",
        ),
        (tf.data.Dataset.from_tensor_slices((x, y, y, y)), "a tuple of 4", "(x, y, sample_weight)"),
        (tf.data.Dataset.from_tensor_slices((x, y, x)), "sample weights have element shape (1,)", "scalar"),
        ((x, y, x), "sample weights have shape (8, 1)", "(n,)"),
    ]
    for data, *needles in cases:

        class Bad(PipelineModule):
            def train_dataset(self, data=data):
                return data

        with pytest.raises(ConfigError) as info:
            _fit(Bad(), tmp_path / "bad", max_epochs=1)
        message = str(info.value)
        assert "\n" not in message and "train_dataset()" in message, message
        for needle in needles:
            assert needle in message, message


@pytest.mark.launch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", ["mirrored", "mwms", "horovod-keras"])
def test_pipelines_sharded_with_uneven_last_batches(tmp_path, variant):
    """mirrored and mwms: 16 training and 9 validation records in TFRecord files of uneven sizes (mwms shards
    by file); horovod: 17 in-memory elements (sharded by element, 9 and 8). Batch 3 per replica leaves uneven
    last batches. Validation sees every record exactly once: val/y is the mean of all labels."""
    procs = STRATEGY_PROCS[variant]
    files = variant != "horovod-keras"
    if files:
        write_records(tmp_path / "data", "train", TRAIN_FILES, seed=1)
        val_y = write_records(tmp_path / "data", "val", VAL_FILES, seed=2)
        init_args = {"folder": str(tmp_path / "data"), "lr": 0.01}
    else:
        val_y = _xy(17, seed=2)[1]
        init_args = {"n": 17, "lr": 0.01}
    config = tmp_path / "pipelines.yaml"
    config.write_text(
        json.dumps(
            {
                "module": {"class_path": "tests.test_keras_pipelines.PipelineModule", "init_args": init_args},
                "trainer": {
                    "max_epochs": 2,
                    "batch_size": 3,
                    "seed": 0,
                    "progress_bar": False,
                    "collective_timeout_s": 60,
                    "root_dir": str(tmp_path / "run"),
                },
            }
        )
    )
    result = run_unifit(
        "launch",
        "--nproc-per-node",
        str(procs),
        "-c",
        str(config),
        "--trainer.strategy",
        strategy_name(variant),
        *STRATEGY_OPTIONS.get(variant, []),
        timeout=280,
    )
    assert_ok(result)
    lines = metrics_lines(tmp_path / "run")
    assert [line["epoch"] for line in lines] == [1, 2]
    for line in lines:
        assert line["val/y"] == pytest.approx(float(val_y.mean()), abs=1e-5), line
        assert np.isfinite(line["train/loss"]) and np.isfinite(line["val/loss"])
    said = "rank {}: train_dataset() is a tf.data pipeline, read lazily, {}: {} samples here ({}), {} used per epoch"
    expected = {
        "mirrored": [said.format(0, "not sharded", 16, "counted", 16)],
        # files 0 and 2 (7 + 4 records) on rank 0, file 1 (5) on rank 1
        "mwms": [
            said.format(0, "sharded by file", 11, "counted", 5),
            said.format(1, "sharded by file", 5, "counted", 5),
        ],
        "horovod-keras": [
            said.format(0, "sharded by element", 9, "cardinality", 8),
            said.format(1, "sharded by element", 8, "cardinality", 8),
        ],
    }[variant]
    for line in expected:
        assert line in result.stderr, result.stderr[-3000:]


@pytest.mark.timeout(120)
def test_mid_epoch_resume_continues_the_pipeline(tmp_path):
    """A checkpoint after step 3 of 6: the resumed run reads on from the 13th element, as the straight one did."""
    straight = PipelineModule(lr=0.05)
    _fit(straight, tmp_path / "straight", max_epochs=2, checkpoint={"every_n_steps": 3, "keep_last_n": 10})
    [mid] = [p for p in (tmp_path / "straight" / "checkpoints").iterdir() if p.name.endswith("step=0000003")]
    resumed = PipelineModule(lr=0.05)
    unifit.Trainer(root_dir=str(tmp_path / "resumed"), max_epochs=2, batch_size=4, seed=0, progress_bar=False).fit(
        resumed, ckpt_path=str(mid)
    )
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert abs(float(straight.model.get_weights()[0][0, 0]) - 1.0) > 1e-3  # it trained
