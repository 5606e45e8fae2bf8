# Horovod's TensorFlow 2 Keras MNIST example (horovod_keras_mnist.py, from
# https://github.com/horovod/horovod/blob/2626dc87a3a8eb8fb7d2216198ce45bce0f9e65a/examples/tensorflow2/tensorflow2_keras_mnist.py,
# Apache License 2.0) ported to unifit: the Horovod lines deleted, the lines marked "unifit" changed.
# Run: unifit launch --nproc-per-node 2 --strategy horovod -- horovod_keras_mnist_unifit.py
# ruff: noqa
# fmt: off

# Copyright 2019 Uber Technologies, Inc. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================

import sys

import offline_mnist  # added: the offline data
import tensorflow as tf

import unifit


def main():
    (mnist_images, mnist_labels), _ = \
        offline_mnist.load_data(path=  # was: tf.keras.datasets.mnist.load_data(path=
            'mnist.npz')  # unifit

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32),
                 tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001  # unifit: the one-process rate; unifit scales it
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
    # uses hvd.DistributedOptimizer() to compute gradients.
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=['accuracy'])  # unifit

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    callbacks = [tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.keras')]  # unifit: Keras 3 wants .keras

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    trainer = unifit.Trainer(max_epochs=24, warmup_epochs=3, callbacks=callbacks)  # unifit
    trainer.fit(mnist_model, dataset, steps_per_epoch=500 // trainer.world_size)  # unifit


if __name__ == '__main__':
    main()
