"""Every private name of TensorFlow and Keras unifit uses (unifit/strategies/tf_compat.py,
unifit/frameworks/keras/keras_compat.py), checked on the installed ones: a release that moves one fails here."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="unifit[tf] is not installed")
pytestmark = pytest.mark.tf

from unifit.frameworks.keras import keras_compat  # noqa: E402
from unifit.strategies import tf_compat  # noqa: E402


def test_a_pipelines_batch_size_is_read_through_per_batch_steps():
    data = tf.data.Dataset.range(20)
    assert tf_compat.batch_size_of(data.batch(4).map(lambda x: x * 2).prefetch(2).repeat()) == 4
    assert tf_compat.batch_size_of(data.padded_batch(3)) == 3
    assert tf_compat.batch_size_of(data.batch(5, num_parallel_calls=2)) == 5
    assert tf_compat.batch_size_of(data.batch(4).unbatch()) is None and tf_compat.batch_size_of(data) is None


def test_auto_sharding_gives_each_worker_its_elements():
    data = tf.data.Dataset.from_tensor_slices(np.arange(10))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    shard = tf_compat.auto_shard(data.with_options(options), 2, 1)
    assert [int(x) for x in shard] == [1, 3, 5, 7, 9]


def test_a_keras_variables_value_checkpoint_hooks_and_numpy_can_be_replaced():
    import keras

    variable = keras.Variable(np.zeros(3, np.float32))
    held = tf_compat.backing_value(variable)
    tf_compat.set_backing_value(variable, tf.constant([1.0, 2.0, 3.0]))
    assert np.array_equal(np.asarray(variable.value), [1.0, 2.0, 3.0])
    tf_compat.set_backing_value(variable, held)
    assert np.array_equal(np.asarray(variable.value), [0.0, 0.0, 0.0])
    store = tf.Variable([5.0, 6.0, 7.0])
    tf_compat.checkpoint_through(variable, read=store.read_value, restore=store.assign, numpy=lambda: store.numpy())
    assert np.array_equal(variable._serialize_to_tensors()["VARIABLE_VALUE"], [5.0, 6.0, 7.0])
    variable._restore_from_tensors({"VARIABLE_VALUE": tf.constant([0.5, 0.5, 0.5])})
    assert np.array_equal(variable.numpy(), [0.5, 0.5, 0.5])
    assert tf_compat.sharded_value(variable) is None  # not partitioned
    import inspect

    from tensorflow.python.trackable.base import Trackable

    assert {"_serialize_to_tensors", "_restore_from_tensors"} <= set(dict(inspect.getmembers(Trackable)))


def test_keras_own_rules_for_compiled_losses_and_metrics():
    import keras

    y, y_pred = keras_compat.same_rank(tf.constant([1.0, 0.0]), tf.constant([[0.9], [0.2]]))
    assert tuple(y.shape) == tuple(y_pred.shape)
    assert keras_compat.binary_or_sparse(tf.constant([[1.0], [0.0]]), tf.constant([[0.9], [0.2]])) == (True, False)
    assert keras_compat.binary_or_sparse(tf.constant([2, 0]), tf.constant([[0.1, 0.2, 0.7]] * 2))[1]
    assert len(keras_compat.metrics_list([keras.metrics.get("accuracy")]).metrics) == 1


def test_keras_layers_seed_streams_and_wrapped_metrics_are_reached():
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dropout(0.5, seed=1)])
    layers = keras_compat.layers_of(model, include_self=False)
    assert [type(layer).__name__ for layer in layers][-2:] == ["Dense", "Dropout"]
    assert keras_compat.layers_of(model, include_self=True)[0] is model
    dense, dropout = layers[-2:]
    assert len(keras_compat.seed_generators(dropout)) == 1 and keras_compat.seed_generators(dense) == []
    fn, kwargs = keras_compat.wrapped_function(
        keras.metrics.MeanMetricWrapper(keras.losses.mean_squared_error, name="m", foo=1)
    )
    assert fn is keras.losses.mean_squared_error and kwargs == {"foo": 1}


def test_a_mirrored_strategys_collective_keys_start_where_asked():
    strategy = tf_compat.made_with_collective_keys_from(tf.distribute.MirroredStrategy, 3000, devices=["/cpu:0"])
    assert strategy._collective_key_base == 3000 and strategy.num_replicas_in_sync == 1
