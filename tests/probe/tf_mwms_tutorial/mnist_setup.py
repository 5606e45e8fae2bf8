# Copyright 2019 The TensorFlow Authors. Licensed under the Apache License, Version 2.0
# (https://www.apache.org/licenses/LICENSE-2.0).
# From TensorFlow's "Multi-worker training with Keras" tutorial
# (https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras, tensorflow/docs
# site/en/tutorials/distribute/multi_worker_with_keras.ipynb), its mnist_setup.py. Changed: the MNIST download is
# replaced by synthetic 28x28 "digits" (a fixed random template per class plus noise), so the test needs no network.

import numpy as np
import tensorflow as tf


def load_data(n=2048, seed=0):
    """Stands in for tf.keras.datasets.mnist.load_data(): uint8 images in [0, 255] and integer labels."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, size=(10, 28, 28))
    y = rng.integers(0, 10, size=n)
    x = np.clip(templates[y] + rng.normal(0, 60, size=(n, 28, 28)), 0, 255).astype(np.uint8)
    return (x, y), (x[:256], y[:256])


def mnist_dataset(batch_size):
    (x_train, y_train), _ = load_data()
    # The `x` arrays are in uint8 and have values in the [0, 255] range.
    # You need to convert them to float32 with values in the [0, 1] range.
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(60000).repeat().batch(batch_size)
    return train_dataset


def build_and_compile_cnn_model():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=(28, 28)),
            tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
        metrics=["accuracy"],
    )
    return model
