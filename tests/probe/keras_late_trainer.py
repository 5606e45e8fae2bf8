"""A keras-io style script that builds its tf.data pipeline before it makes the Trainer: under mwms (and
mirrored on logical CPUs) TensorFlow has started by then, so unifit says in one line what to move."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import unifit  # noqa: E402

pipeline = tf.data.Dataset.from_tensor_slices((np.zeros((8, 2), np.float32), np.zeros(8, np.int64))).batch(4)
list(pipeline.take(1))  # a TensorFlow op: TensorFlow starts here
unifit.Trainer(max_epochs=1, root_dir=sys.argv[1], progress_bar=False)
