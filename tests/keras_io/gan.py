# Copyright 2019 The Keras Authors (keras-io, examples/generative/dcgan_overriding_train_step.py, Keras 3
# version by fchollet). Licensed under the Apache License, Version 2.0: http://www.apache.org/licenses/LICENSE-2.0
#
# Taken as keras.io shows it: a GAN with its own compile(d_optimizer, g_optimizer, loss_fn), its own metrics and
# train_step, two optimizers. Changed for the tests: the data is drawn offline (no MNIST download), the layers
# are 8x narrower (16/32 filters, latent 16) to run fast on CPUs, the label noise draws from the model's seed
# generator (the tutorial's unseeded tf.random.uniform differs between any two runs), and make_gan() wraps the
# tutorial's building code so a strategy can call it inside its scope.
import keras
import tensorflow as tf
from keras import layers, ops

from tests.keras_io.vae import digits

LATENT_DIM = 16


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        # Sample random points in the latent space
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)

        # Decode them to fake images
        generated_images = self.generator(random_latent_vectors)

        # Combine them with real images
        combined_images = ops.concatenate([generated_images, real_images], axis=0)

        # Assemble labels discriminating real from fake images
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        # Add random noise to the labels - important trick!
        labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)

        # Train the discriminator
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        # Sample random points in the latent space
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)

        # Assemble labels that say "all real images"
        misleading_labels = ops.zeros((batch_size, 1))

        # Train the generator (note that we should *not* update the weights
        # of the discriminator)!
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        # Update metrics
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {
            "d_loss": self.d_loss_metric.result(),
            "g_loss": self.g_loss_metric.result(),
        }


def make_gan(seed: int = 0, learning_rate: float = 0.0003):
    """The tutorial's discriminator, generator and GAN, compiled as it compiles them."""
    keras.utils.set_random_seed(seed)
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(16, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(32, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input(shape=(LATENT_DIM,)),
            # We want to generate 32 coefficients to reshape into a 7x7x32 map
            layers.Dense(7 * 7 * 32),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((7, 7, 32)),
            layers.Conv2DTranspose(32, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(32, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, kernel_size=5, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    gan = GAN(discriminator=discriminator, generator=generator, latent_dim=LATENT_DIM)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=learning_rate),
        g_optimizer=keras.optimizers.Adam(learning_rate=learning_rate),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return gan


def dataset(n: int = 64, batch_size: int = 16):
    """The tutorial's pipeline over offline digits: from_tensor_slices(...).batch(batch_size) (not shuffled, so
    two runs read one order)."""
    return tf.data.Dataset.from_tensor_slices(digits(n, seed=1)).batch(batch_size)


class Images:
    """dataset() unbatched, as a data provider (built when the engine asks, after the strategy was made)."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def train_dataset(self):
        return dataset(self.n).unbatch()
