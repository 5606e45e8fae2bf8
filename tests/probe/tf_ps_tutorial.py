# ruff: noqa: UP031  (the tutorial's own print formatting)
# Copyright 2020 The TensorFlow Authors. Licensed under the Apache License, Version 2.0
# (https://www.apache.org/licenses/LICENSE-2.0).
# From TensorFlow's "Parameter server training with ParameterServerStrategy" tutorial
# (https://www.tensorflow.org/tutorials/distribute/parameter_server_training, tensorflow/docs
# site/en/tutorials/distribute/parameter_server_training.ipynb): its custom training loop, run as the coordinator of
# a real cluster as its "Clusters in the real world" section says (TF_CONFIG + TFConfigClusterResolver instead of
# the in-process cluster). Its data are its own toy examples. Changed for Keras 3 (what tf.keras is with TensorFlow
# 2.16+): reduction=None for Reduction.NONE, reset_state() for reset_states(), keras.ops.mean for tf.reduce_mean on
# a symbolic Keras tensor, the preprocessing models mapped over batches (Keras 3 checks their batch axis), the
# variables not partitioned (below); and a last line for the test to read. (Its Model.fit path needs
# tf.keras.utils.experimental.DatasetCreator, which Keras 3 no longer has.)
import json
import os
import random

import tensorflow as tf

NUM_PS = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"])
cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()

variable_partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
    min_shard_bytes=(256 << 10), max_shards=NUM_PS
)
# Keras 3 cannot take a gradient of a partitioned (ShardedVariable) weight ("no attribute 'handle'"): whole variables
strategy = tf.distribute.experimental.ParameterServerStrategy(cluster_resolver, variable_partitioner=None)

feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]

with strategy.scope():
    feature_lookup_layer = tf.keras.layers.StringLookup(vocabulary=feature_vocab, mask_token=None)
    label_lookup_layer = tf.keras.layers.StringLookup(vocabulary=label_vocab, num_oov_indices=0, mask_token=None)

    raw_feature_input = tf.keras.layers.Input(shape=(3,), dtype=tf.string, name="feature")
    feature_id_input = feature_lookup_layer(raw_feature_input)
    feature_preprocess_stage = tf.keras.Model({"features": raw_feature_input}, feature_id_input)

    raw_label_input = tf.keras.layers.Input(shape=(1,), dtype=tf.string, name="label")
    label_id_input = label_lookup_layer(raw_label_input)
    label_preprocess_stage = tf.keras.Model({"label": raw_label_input}, label_id_input)


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


examples = feature_and_label_gen()


def dataset_fn(_):
    raw_dataset = tf.data.Dataset.from_tensor_slices(examples)
    train_dataset = (
        raw_dataset.shuffle(200)
        .batch(32)
        .map(lambda x: ({"features": feature_preprocess_stage(x["features"])}, label_preprocess_stage(x["label"])))
        .repeat()
    )
    return train_dataset


with strategy.scope():
    model_input = tf.keras.layers.Input(shape=(3,), dtype=tf.int64, name="model_input")
    emb_layer = tf.keras.layers.Embedding(input_dim=len(feature_lookup_layer.get_vocabulary()), output_dim=16384)
    emb_output = tf.keras.ops.mean(emb_layer(model_input), axis=1)
    dense_output = tf.keras.layers.Dense(units=1, activation="sigmoid")(emb_output)
    model = tf.keras.Model({"features": model_input}, dense_output)

    optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.1)
    accuracy = tf.keras.metrics.Accuracy()


@tf.function
def step_fn(iterator):
    def replica_fn(batch_data, labels):
        with tf.GradientTape() as tape:
            pred = model(batch_data, training=True)
            per_example_loss = tf.keras.losses.BinaryCrossentropy(reduction=None)(labels, pred)
            loss = tf.nn.compute_average_loss(per_example_loss)
            gradients = tape.gradient(loss, model.trainable_variables)

        optimizer.apply_gradients(zip(gradients, model.trainable_variables))

        actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
        accuracy.update_state(labels, actual_pred)
        return loss

    batch_data, labels = next(iterator)
    losses = strategy.run(replica_fn, args=(batch_data, labels))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)


@tf.function
def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

num_epoches = 4
steps_per_epoch = 5
for i in range(num_epoches):
    accuracy.reset_state()
    for _ in range(steps_per_epoch):
        coordinator.schedule(step_fn, args=(per_worker_iterator,))
    # Wait at epoch boundaries.
    coordinator.join()
    print("Finished epoch %d, accuracy is %f." % (i, accuracy.result().numpy()))

loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
print("Final loss is %f" % loss.fetch())

eval_dataset = (
    tf.data.Dataset.from_tensor_slices(feature_and_label_gen(num_examples=16))
    .batch(8)
    .map(lambda x: ({"features": feature_preprocess_stage(x["features"])}, label_preprocess_stage(x["label"])))
)
eval_accuracy = tf.keras.metrics.Accuracy()
for batch_data, labels in eval_dataset:
    pred = model(batch_data, training=False)
    actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
    eval_accuracy.update_state(labels, actual_pred)
print("Evaluation accuracy: %f" % eval_accuracy.result())
print(
    "workers: %d, parameter servers: %d, embedding shards: %d"
    % (len(cluster_resolver.cluster_spec().as_dict()["worker"]), NUM_PS, len(emb_layer.weights)),
    flush=True,
)
