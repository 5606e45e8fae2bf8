"""The Keras zoo: two keras-io examples as their pages write them, scaled down, on synthetic data (no
download), compiled keras.Models with batched tf.data pipelines, which is how users bring them.

- image: "Image classification from scratch" (keras-io/examples/vision/image_classification_from_scratch):
  the data-augmentation layers mapped over the batched dataset, make_model's Rescaling, strided Conv2D,
  BatchNormalization and residual SeparableConv2D blocks (2 blocks of 16/32 filters instead of 4 of 256-728,
  32x32 images instead of 180x180, dropout 0 so the strategies can be compared);
- text: "Text classification from scratch" (keras-io/examples/nlp/text_classification_from_scratch):
  TextVectorization adapted on the raw text and mapped over the batched dataset, Embedding, Conv1D,
  GlobalMaxPooling1D and a sigmoid output, binary cross-entropy (a 200-word vocabulary, 16-token sentences);
- weather: "Timeseries forecasting for weather prediction" (keras-io/examples/timeseries/timeseries_weather_forecasting):
  normalised features, keras.utils.timeseries_dataset_from_array windows (sampling_rate 6), an LSTM(32) and a
  Dense(1), Adam and mse, and its callbacks: EarlyStopping(monitor="val_loss", min_delta=0, patience) and
  ModelCheckpoint(save_weights_only=True, save_best_only=True) (7 synthetic features instead of the Jena
  climate set, patience 1 instead of 5 for the zoo's few epochs).

Each builder returns (compiled model, training pipeline, validation pipeline, per-replica batch); the
same seed gives the same weights and data in every process."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import layers

IMAGE, CLASSES, N_IMAGES = 32, 4, 96
VOCAB, TOKENS, N_TEXTS = 200, 16, 128


# ---- image classification from scratch ---------------------------------------------------------
def _images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images whose class is the brightest colour channel (learnable), with noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    x = rng.integers(0, 160, (n, IMAGE, IMAGE, 3))
    for i, label in enumerate(y):
        x[i, :, :, label % 3] += 60 + 30 * (label // 3)
    return x.astype(np.float32), y.astype(np.int32)


def make_model(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    inputs = keras.Input(shape=input_shape)
    x = layers.Rescaling(1.0 / 255)(inputs)
    x = layers.Conv2D(16, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    previous_block_activation = x
    for size in [16, 32]:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])
        previous_block_activation = x
    x = layers.SeparableConv2D(32, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.0)(x)
    outputs = layers.Dense(num_classes, activation=None)(x)
    return keras.Model(inputs, outputs)


def image_classifier(batch: int, augment: bool = True) -> tuple[Any, Any, Any, int]:
    keras.utils.set_random_seed(0)
    data_augmentation_layers = [layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)]

    def data_augmentation(images: Any) -> Any:
        for layer in data_augmentation_layers:
            images = layer(images)
        return images

    train_ds = tf.data.Dataset.from_tensor_slices(_images(N_IMAGES, seed=1)).batch(batch)
    val_ds = tf.data.Dataset.from_tensor_slices(_images(N_IMAGES // 2, seed=2)).batch(batch)
    if augment:  # keras-io: "apply data_augmentation to the training images", on the batched dataset
        train_ds = train_ds.map(lambda img, label: (data_augmentation(img), label), num_parallel_calls=tf.data.AUTOTUNE)
    train_ds = train_ds.prefetch(tf.data.AUTOTUNE)
    model = make_model(input_shape=(IMAGE, IMAGE, 3), num_classes=CLASSES)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
    )
    return model, train_ds, val_ds, batch


# ---- text classification from scratch ----------------------------------------------------------
def _texts(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sentences of common words plus a few 'good'/'bad' words; the label is which kind is more frequent."""
    rng = np.random.default_rng(seed)
    common = [f"w{i}" for i in range(VOCAB - 40)]
    good, bad = [f"good{i}" for i in range(20)], [f"bad{i}" for i in range(20)]
    texts, labels = [], []
    for _ in range(n):
        label = int(rng.integers(0, 2))
        words = list(rng.choice(common, TOKENS - 4)) + list(rng.choice(good if label else bad, 3))
        words += list(rng.choice(bad if label else good, 1))
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(label)
    return np.array(texts), np.array(labels, dtype=np.float32)


def text_classifier(batch: int) -> tuple[Any, Any, Any, int]:
    keras.utils.set_random_seed(0)
    raw_train_ds = tf.data.Dataset.from_tensor_slices(_texts(N_TEXTS, seed=1)).batch(batch)
    raw_val_ds = tf.data.Dataset.from_tensor_slices(_texts(N_TEXTS // 2, seed=2)).batch(batch)
    vectorize_layer = layers.TextVectorization(max_tokens=VOCAB, output_mode="int", output_sequence_length=TOKENS)
    vectorize_layer.adapt(raw_train_ds.map(lambda x, y: x))

    def vectorize_text(text: Any, label: Any) -> tuple[Any, Any]:
        text = tf.expand_dims(text, -1)
        return vectorize_layer(text), label

    train_ds = raw_train_ds.map(vectorize_text).cache().prefetch(buffer_size=10)
    val_ds = raw_val_ds.map(vectorize_text).cache().prefetch(buffer_size=10)
    inputs = keras.Input(shape=(None,), dtype="int64")
    x = layers.Embedding(VOCAB, 16)(inputs)
    x = layers.Dropout(0.0)(x)
    x = layers.Conv1D(16, 7, padding="valid", activation="relu", strides=3)(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(16, activation="relu")(x)
    x = layers.Dropout(0.0)(x)
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = keras.Model(inputs, predictions)
    # steps_per_execution is not on the page: the zoo's text model runs 3 batches per compiled call (4 batches an
    # epoch: calls of 3 and 1) under every strategy, and its crash and resume fall between calls (issue #53)
    model.compile(
        loss="binary_crossentropy", optimizer=keras.optimizers.Adam(1e-2), metrics=["accuracy"], steps_per_execution=3
    )
    return model, train_ds, val_ds, batch


# ---- timeseries forecasting for weather prediction ---------------------------------------------
STEP, PAST, FUTURE, FEATURES = 6, 120, 12, 7


def _climate(n: int, seed: int) -> np.ndarray:
    """Seven smooth daily-cycle signals with noise; the first is the temperature to forecast."""
    rng = np.random.default_rng(seed)
    t = np.arange(n, dtype=np.float64)
    phases = rng.uniform(0, 2 * np.pi, FEATURES)
    series = np.sin(2 * np.pi * t[:, None] / 144 + phases) + 0.1 * rng.normal(size=(n, FEATURES))
    return series.astype(np.float32)


def normalize(data: np.ndarray, train_split: int) -> np.ndarray:
    data_mean = data[:train_split].mean(axis=0)
    data_std = data[:train_split].std(axis=0)
    return (data - data_mean) / data_std


def weather_forecaster(batch: int) -> tuple[Any, Any, Any, int]:
    keras.utils.set_random_seed(0)
    features = normalize(_climate(3000, seed=3), 2000)
    train_data, val_data = features[:2000], features[2000:]
    start, sequence_length = PAST + FUTURE, int(PAST / STEP)
    x_train, y_train = train_data[: 2000 - start], features[start:2000][:, [0]]
    dataset_train = keras.utils.timeseries_dataset_from_array(
        x_train, y_train, sequence_length=sequence_length, sampling_rate=STEP, batch_size=batch
    )
    x_end = len(val_data) - start
    x_val, y_val = val_data[:x_end], features[2000 + start :][:, [0]]
    dataset_val = keras.utils.timeseries_dataset_from_array(
        x_val, y_val, sequence_length=sequence_length, sampling_rate=STEP, batch_size=batch
    )
    inputs = keras.layers.Input(shape=(sequence_length, FEATURES))
    lstm_out = keras.layers.LSTM(32)(inputs)
    outputs = keras.layers.Dense(1)(lstm_out)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.001), loss="mse")
    return model, dataset_train, dataset_val, batch


def weather_callbacks(folder: str) -> list[Any]:
    """The example's callbacks, as it writes them (its checkpoint path in `folder`)."""
    path_checkpoint = f"{folder}/model_checkpoint.weights.h5"
    es_callback = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=1)
    modelckpt_callback = keras.callbacks.ModelCheckpoint(
        monitor="val_loss", filepath=path_checkpoint, verbose=1, save_weights_only=True, save_best_only=True
    )
    return [es_callback, modelckpt_callback]


MODELS = {
    "image": image_classifier,
    "text": text_classifier,
    # without its random augmentation: what can be compared number for number across strategies
    "image-plain": lambda batch: image_classifier(batch, augment=False),
    "weather": weather_forecaster,
}
CALLBACKS = {"weather": weather_callbacks}  # the callbacks a model's page passes to model.fit
