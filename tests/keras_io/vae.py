# Copyright 2020 The Keras Authors (keras-io, examples/generative/vae.py, Keras 3 version by fchollet).
# Licensed under the Apache License, Version 2.0: http://www.apache.org/licenses/LICENSE-2.0
#
# Taken as keras.io shows it: a keras.Model with its own train_step and metrics, compiled with an optimizer
# and no loss, trained by `vae.fit(mnist_digits, epochs=30, batch_size=128)`. Changed for the tests, nothing
# in the model: the data is 28x28 images drawn offline (digits(), no MNIST download), and make_vae() wraps the
# tutorial's building code so a strategy can call it inside its scope.
import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [
            self.total_loss_tracker,
            self.reconstruction_loss_tracker,
            self.kl_loss_tracker,
        ]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction),
                    axis=(1, 2),
                )
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def make_vae(seed: int = 0):
    """The tutorial's encoder, decoder and VAE, compiled as it compiles them."""
    keras.utils.set_random_seed(seed)
    latent_dim = 2

    encoder_inputs = keras.Input(shape=(28, 28, 1))
    x = layers.Conv2D(32, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Conv2D(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(7 * 7 * 64, activation="relu")(latent_inputs)
    x = layers.Reshape((7, 7, 64))(x)
    x = layers.Conv2DTranspose(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(32, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")

    vae = VAE(encoder, decoder)
    vae.compile(optimizer=keras.optimizers.Adam())
    return vae


def digits(n: int = 64, seed: int = 0) -> np.ndarray:
    """Stand-ins for MNIST digits, offline: (n, 28, 28, 1) float32 in [0, 1], a bright stroke on a dark field."""
    rng = np.random.default_rng(seed)
    images = rng.random((n, 28, 28, 1)).astype("float32") * 0.2
    rows = rng.integers(4, 20, size=n)
    for i, row in enumerate(rows):
        images[i, row : row + 5, 6:22, 0] = 0.9
    return images


class Digits:
    """digits() as a data provider (YAML: data.class_path), x alone as vae.fit(mnist_digits) takes it."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def train_dataset(self):
        return tf.data.Dataset.from_tensor_slices(digits(self.n))


class VAEWithCall(VAE):
    """The tutorial's VAE with the call() its earlier (tf.keras) version had: Keras 3's model.fit under a
    tf.distribute strategy cannot build the VAE without one ("Unable to automatically build the model"), so
    model.fit's reference run under mirrored takes this; unifit trains the tutorial's VAE as it is."""

    def call(self, x):
        z_mean, z_log_var, z = self.encoder(x)
        return self.decoder(z)


def make_vae_with_call(seed: int = 0):
    vae = make_vae(seed)
    model = VAEWithCall(vae.encoder, vae.decoder)
    model.compile(optimizer=keras.optimizers.Adam())
    return model
