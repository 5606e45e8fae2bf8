"""A compiled keras.Model passed to Trainer.fit (frameworks/keras/compiled.py): it trains as model.fit
does, under single, mirrored, mwms and horovod, and what unifit cannot honour is refused in one line.

Every run here takes one full batch per epoch (global batch = all training samples, lr_scaling none),
so the data order does not matter and the result must equal Keras' own model.fit on the same data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import STRATEGY_OPTIONS, STRATEGY_PROCS, assert_ok, reports, run_unifit, strategy_name
from tests.probe.keras_compiled_probe import N_TRAIN, N_VAL, arrays, compiled_model

pytestmark = pytest.mark.tf

EPOCHS = 3


def _reference(form: str, initial: list | None = None):
    """Keras' own model.fit, full batch, from the same initial weights."""
    model = compiled_model(form)
    if initial is not None:
        model.set_weights([np.asarray(w, dtype=np.float32) for w in initial])
    x, y = arrays(N_TRAIN, seed=1)
    model.fit(x, y, batch_size=N_TRAIN, epochs=EPOCHS, shuffle=False, verbose=0)
    return model, model.evaluate(*arrays(N_VAL, seed=2), verbose=0, return_dict=True)


def _fit(model, data, tmp_path, **options):
    import unifit

    trainer = unifit.Trainer(
        max_epochs=EPOCHS, batch_size=N_TRAIN, root_dir=str(tmp_path), progress_bar=False, seed=0, **options
    )
    trainer.fit(model, data=data)  # returns model.fit's History; the fit's state:
    return trainer.state


def _close(a, b, tol=1e-5):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=tol, rtol=0)


@pytest.mark.timeout(240)
def test_a_batched_pipeline_trains_with_its_own_batch_size(tmp_path):
    """keras-io's habit: the user's tf.data pipeline ends in .batch(n) (and a map after it). Without
    trainer.batch_size unifit adopts n and trains as model.fit on that dataset; a different batch_size is
    refused in one line."""
    import tensorflow as tf

    import unifit
    from unifit.errors import ConfigError

    model = compiled_model("objects")
    initial = model.get_weights()
    x, y = arrays(N_TRAIN, seed=1)
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).batch(N_TRAIN).map(lambda a, b: (a * 2.0, b))
    trainer = unifit.Trainer(max_epochs=EPOCHS, root_dir=str(tmp_path), progress_bar=False, seed=0)
    trainer.fit(model, data={"train": pipeline})
    state = trainer.state
    assert state.progress.global_batch == N_TRAIN and state.progress.steps_per_epoch == 1
    reference = compiled_model("objects")
    reference.set_weights(initial)
    reference.fit(pipeline, epochs=EPOCHS, shuffle=False, verbose=0)
    _close(model.get_weights(), reference.get_weights())
    with pytest.raises(ConfigError, match=rf"batched by {N_TRAIN} but trainer.batch_size is 4; leave"):
        unifit.Trainer(max_epochs=1, batch_size=4, root_dir=str(tmp_path / "b"), progress_bar=False).fit(
            compiled_model("objects"), data={"train": pipeline}
        )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("form, metric", [("objects", "sparse_categorical_accuracy"), ("strings", "accuracy")])
def test_single_equals_model_fit(tmp_path, form, metric):
    model = compiled_model(form)
    initial = model.get_weights()
    data = {"train": arrays(N_TRAIN, seed=1), "val": arrays(N_VAL, seed=2)}
    state = _fit(model, data, tmp_path)
    reference, evaluated = _reference(form)
    _close(model.get_weights(), reference.get_weights())  # the user's object holds the trained weights
    assert max(np.abs(a - b).max() for a, b in zip(model.get_weights(), initial)) > 1e-3  # it did train
    # validation runs on the trained weights: the same numbers as Keras' evaluate
    assert state.metrics["val/loss"] == pytest.approx(evaluated["loss"], abs=1e-5)
    assert state.metrics[f"val/{metric}"] == pytest.approx(evaluated[metric], abs=1e-6)
    assert f"train/{metric}" in state.metrics


@pytest.mark.timeout(240)
def test_stateful_compiled_metrics_equal_model_evaluate(tmp_path):
    """AUC and Precision (not means) from model.compile: unifit's val/auc is Keras' own evaluate on the trained model."""
    import keras

    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 0.5, 0.0]) > 0).astype(np.float32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="sgd", loss="binary_crossentropy", metrics=[keras.metrics.AUC(), "precision"])
    state = _fit(model, {"train": (x[:32], y[:32]), "val": (x[32:], y[32:])}, tmp_path)
    evaluated = model.evaluate(x[32:], y[32:], verbose=0, return_dict=True)
    assert state.metrics["val/auc"] == pytest.approx(evaluated["auc"], abs=1e-6)
    assert state.metrics["val/precision"] == pytest.approx(evaluated["precision"], abs=1e-6)


@pytest.mark.timeout(240)
def test_data_forms_train_alike(tmp_path):
    """(x, y), an unbatched tf.data.Dataset and a data provider give the same training."""
    import tensorflow as tf

    from tests.probe.keras_compiled_probe import Data

    x, y = arrays(N_TRAIN, seed=1)
    results = []
    for i, data in enumerate([(x, y), tf.data.Dataset.from_tensor_slices((x, y)), Data()]):
        model = compiled_model("objects")
        state = _fit(model, data, tmp_path / str(i))
        results.append(model.get_weights())
        assert ("val/loss" in state.metrics) == isinstance(data, Data)
    _close(results[0], results[1], tol=1e-6)  # the dataset is read lazily in its own order (not shuffled by unifit)
    _close(results[0], results[2], tol=0)
    # a function that builds the compiled model, called by unifit inside the strategy's scope
    from unifit.frameworks.keras.compiled import CompiledModel

    lazy = CompiledModel(compiled_model, model_args={"form": "objects"}, data=(x, y))
    _fit(lazy, None, tmp_path / "lazy")
    _close(results[0], lazy.model.get_weights(), tol=0)
    _close(results[0], _reference("objects")[0].get_weights())


# ---- mirrored, mwms, horovod: one launch each, from YAML -------------------------------------------
# mirrored (logical CPU devices) and mwms must be made before TensorFlow starts, so their YAML names the
# factory through CompiledModel, which calls it inside the strategy's scope; horovod's YAML names the
# factory function itself as module.class_path (the model is built first, copied, and copied back).
FACTORY = "tests.probe.keras_compiled_probe.compiled_model"
LAZY = {
    "class_path": "unifit.frameworks.keras.compiled.CompiledModel",
    "init_args": {"model": FACTORY, "model_args": {"form": "objects"}},
}
DIRECT = {"class_path": FACTORY, "init_args": {"form": "objects"}}


@pytest.mark.launch
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "variant, module",
    [("mirrored", LAZY), ("mwms", LAZY), ("horovod-keras", DIRECT)],
    ids=["mirrored", "mwms", "horovod-keras"],
)
def test_distributed_equals_model_fit(tmp_path, variant, module):
    procs = STRATEGY_PROCS[variant]
    replicas = 2
    yaml_file = tmp_path / "compiled.yaml"
    yaml_file.write_text(
        json.dumps(
            {
                "module": module,
                "data": {"class_path": "tests.probe.keras_compiled_probe.Data"},
                "trainer": {
                    "max_epochs": EPOCHS,
                    "batch_size": N_TRAIN // replicas,
                    "lr_scaling": "none",
                    "seed": 0,
                    "progress_bar": False,
                    "collective_timeout_s": 60,
                    "root_dir": str(tmp_path / "run"),
                    "callbacks": [
                        {
                            "class_path": "tests.probe.keras_compiled_probe.WeightsReport",
                            "init_args": {"out_dir": str(tmp_path / "run" / "reports")},
                        }
                    ],
                },
            }
        )
    )
    result = run_unifit(
        "launch",
        "--nproc-per-node",
        str(procs),
        "-c",
        str(yaml_file),
        "--trainer.strategy",
        strategy_name(variant),
        *STRATEGY_OPTIONS.get(variant, []),
        timeout=280,
    )
    assert_ok(result)
    found = reports(tmp_path / "run")
    assert [r["rank"] for r in found] == list(range(procs)) and all(r["world_size"] == procs for r in found)
    reference, evaluated = _reference("objects", initial=found[0]["initial"])
    _close(found[0]["initial"], compiled_model("objects").get_weights(), tol=0)  # the factory's own weights
    for r in found:
        assert r["replicas_identical"]
        assert r["user_is_trained_copy"] == (module is DIRECT)
        _close(r["initial"], found[0]["initial"], tol=0)
        _close(r["trained"], found[0]["trained"], tol=0)  # identical on every rank
        _close(r["user"], r["trained"], tol=0)  # the user's model object holds them
        _close(r["trained"], reference.get_weights())  # = model.fit on the whole batch
        assert r["metrics"]["val/loss"] == pytest.approx(evaluated["loss"], abs=1e-5)
        assert r["metrics"]["val/sparse_categorical_accuracy"] == pytest.approx(
            evaluated["sparse_categorical_accuracy"], abs=1e-6
        )
        assert "train/sparse_categorical_accuracy" in r["metrics"]


# ---- refused in one line ----------------------------------------------------------------------------
def _refused(model, *needles, data=None):
    from unifit.errors import ConfigError
    from unifit.trainer.adapt import trainable

    with pytest.raises(ConfigError) as info:
        adapter, data = trainable(model, data)
        adapter.train_dataset()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def _sequential(outputs: int = 3):
    import keras

    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(outputs)])


@pytest.mark.timeout(120)
def test_bad_input_is_refused_in_one_line():
    import keras
    import tensorflow as tf

    xy = arrays(N_TRAIN, seed=1)
    _refused(_sequential(), "is not compiled", "call model.compile(optimizer=..., loss=...) first", data=xy)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for kwargs, needle in [
        ({"run_eagerly": True}, "run_eagerly=True"),
    ]:
        model = _sequential()
        model.compile(optimizer="sgd", loss=loss, **kwargs)
        _refused(model, needle, data=xy)

    inputs = keras.Input((4,))
    two = keras.Model(inputs, [keras.layers.Dense(1)(inputs), keras.layers.Dense(1)(inputs)])
    two.compile(optimizer="sgd", loss=["mse", "mse"])
    _refused(two, "has 2 outputs", data=xy)

    model = _sequential()
    model.compile(optimizer="sgd", loss=loss)
    _refused(model, "a keras.Model brings no data", "data=(x, y)")
    batched_elsewhere = tf.data.Dataset.from_generator(
        lambda: iter([xy]), output_signature=(tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None,), tf.int64))
    )
    _refused(model, "looks batched", "by something other than .batch()", "unbatch()", data=batched_elsewhere)
    _refused(model, "keys ['training']", data={"training": xy})

    class Subclassed(keras.Model):  # no get_config/from_config that rebuild it
        def __init__(self, units):
            super().__init__()
            self.dense = keras.layers.Dense(units)

        def call(self, x):
            return self.dense(x)

    sub = Subclassed(3)
    sub.compile(optimizer="sgd", loss=loss)
    from unifit.errors import ConfigError
    from unifit.trainer.adapt import trainable

    adapter, _ = trainable(sub, xy)
    assert adapter.build_model() is sub  # single / horovod: trained as it is
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope(), pytest.raises(ConfigError) as info:
        adapter.build_model()
    assert "\n" not in str(info.value) and "subclassed keras.Model" in str(info.value)
    assert "trainer.strategy single, horovod" in str(info.value) and "MirroredStrategy" in str(info.value)


def test_rebuilt_model_takes_the_mixed_policy_and_the_users_weights():
    """Under trainer.precision's mixed policy (set while build_model() runs) layers on Keras' default
    float32 policy compute in the low dtype; the weights are the user's."""
    import keras

    from tests.probe.keras_compiled_probe import compiled_model
    from unifit.trainer.adapt import trainable

    adapter, _ = trainable(compiled_model("objects"), arrays(N_TRAIN, seed=1))
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = adapter.build_model()
    finally:
        keras.config.set_dtype_policy(previous)
    assert model is not adapter.user_model
    assert [layer.dtype_policy.name for layer in model.layers] == ["mixed_bfloat16"] * 2
    _close(model.get_weights(), adapter.user_model.get_weights(), tol=0)


@pytest.mark.timeout(240)
def test_resume_continues_as_an_uninterrupted_run(tmp_path):
    import unifit

    data = {"train": arrays(N_TRAIN, seed=1), "val": arrays(N_VAL, seed=2)}
    straight = compiled_model("objects")
    _fit(straight, data, tmp_path / "straight")
    first = compiled_model("objects")
    unifit.Trainer(
        max_epochs=EPOCHS - 1, batch_size=N_TRAIN, root_dir=str(tmp_path / "resumed"), progress_bar=False, seed=0
    ).fit(first, data=data)
    resumed = compiled_model("objects")  # fresh weights: the checkpoint's must replace them
    unifit.Trainer(
        max_epochs=EPOCHS, batch_size=N_TRAIN, root_dir=str(tmp_path / "resumed"), progress_bar=False, seed=0
    ).fit(resumed, data=data, ckpt_path="last")
    _close(resumed.get_weights(), straight.get_weights(), tol=0)


@pytest.mark.timeout(120)
def test_a_subclassed_model_built_at_its_first_call_trains_as_model_fit(tmp_path):
    """A keras.Model subclass whose layers build at their first call (no build(), no Input): Keras' build() marks
    it built and creates nothing; unifit creates its variables before the optimizer is built, as model.fit's first
    batch does (it failed with "not enough values to unpack" before)."""
    import keras

    class Subclassed(keras.Model):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.hidden, self.out = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)

        def call(self, x):
            return self.out(self.hidden(x))

    def model():
        keras.utils.set_random_seed(0)
        m = Subclassed()
        m.compile(
            optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        return m

    ours, theirs = model(), model()
    _fit(ours, arrays(N_TRAIN, seed=1), tmp_path, lr_scaling="none")
    theirs.fit(*arrays(N_TRAIN, seed=1), batch_size=N_TRAIN, epochs=EPOCHS, shuffle=False, verbose=0)
    assert len(ours.get_weights()) == 4
    _close(ours.get_weights(), theirs.get_weights())


def test_activation_checkpointing_and_compiling_per_block_point_a_keras_model_elsewhere(tmp_path):
    import unifit
    from unifit.errors import ConfigError

    model = _sequential()
    model.compile(optimizer="sgd", loss="mse")
    trainer = unifit.Trainer(max_epochs=1, activation_checkpointing="full", root_dir=str(tmp_path), progress_bar=False)
    with pytest.raises(ConfigError, match=r"activation_checkpointing: full recomputes a PyTorch .*RematScope"):
        trainer.fit(model, data=arrays(N_TRAIN, seed=1))
    trainer = unifit.Trainer(max_epochs=1, compile="blocks", root_dir=str(tmp_path), progress_bar=False)
    with pytest.raises(ConfigError, match=r"compile: blocks compiles a PyTorch model's blocks .*set compile: true"):
        trainer.fit(model, data=arrays(N_TRAIN, seed=1))
