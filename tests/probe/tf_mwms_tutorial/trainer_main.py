"""The model and data of TensorFlow's multi-worker Keras tutorial (mnist_setup.py here) trained through unifit's
Trainer (the model built in the strategy's scope by CompiledModel), 2 workers under `unifit launch --strategy mwms`:
trainer_main.py ok|fail ROOT_DIR. Each worker prints "trained" after fit; `fail` raises instead (the job must then
exit non-zero)."""

import sys

import mnist_setup
import numpy as np

import unifit
from unifit.frameworks.keras.compiled import CompiledModel

(x, y), (x_val, y_val) = mnist_setup.load_data(n=512)
x, x_val = x / np.float32(255), x_val / np.float32(255)
trainer = unifit.Trainer(strategy="mwms", max_epochs=2, batch_size=64, progress_bar=False, root_dir=sys.argv[-1])
data = {"train": (x, y.astype(np.int64)), "val": (x_val, y_val.astype(np.int64))}
trainer.fit(CompiledModel(mnist_setup.build_and_compile_cnn_model, data=data))
if sys.argv[1] == "fail":
    raise RuntimeError("the script failed after training")
print("trained", flush=True)
