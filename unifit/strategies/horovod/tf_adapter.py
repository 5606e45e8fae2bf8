"""Horovod's training part for Keras modules (its row in the registry's table), also the horovod.tensorflow
binding its collectives go through: a grouped allreduce of the gradients inside the compiled step, and
a broadcast of each variable's value from rank 0.

Horovod's own broadcast_variables, DistributedGradientTape and Keras callbacks expect Keras 2 and
fail on Keras 3 variables, so only its tensor ops are used here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from unifit.strategies.horovod.strategy import Binding, import_horovod
from unifit.strategies.keras_training import KerasTraining

if TYPE_CHECKING:
    from unifit.strategies.horovod.strategy import HorovodStrategy


class TFHorovod(KerasTraining, Binding):
    errors = (tf.errors.OpError, RuntimeError)
    strategy: HorovodStrategy

    def __init__(self, strategy: HorovodStrategy) -> None:
        super().__init__(strategy)
        self.hvd = import_horovod("tensorflow", "HOROVOD_WITH_TENSORFLOW")

    def pin_device(self, local_rank: int, accelerator: str) -> None:
        gpus = tf.config.list_physical_devices("GPU") if accelerator in ("auto", "gpu") else []
        if gpus:  # GPU path per Horovod's docs; verified on CPU only
            tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")
            tf.config.experimental.set_memory_growth(gpus[local_rank % len(gpus)], True)

    def all_reduce(self, values: np.ndarray, op: str, name: str) -> np.ndarray:
        hvd = self.hvd
        return hvd.allreduce(tf.constant(values), op=hvd.Sum if op == "sum" else hvd.Max, name=name).numpy()

    def reduce_gradients(self, grads: list[Any]) -> list[Any]:
        """Averaged over processes in one fused operation (called inside the tf.function step).

        Under 16-mixed the gradients arrive multiplied by the loss scale, which is the same on every
        rank (it starts equal and every rank takes the same skip decisions on the same averaged
        gradients), so the average is consistently scaled and the LossScaleOptimizer unscales it
        afterwards; an inf on one rank becomes inf on all, and every rank skips that step."""
        if self.strategy.world_size == 1:
            return grads
        hvd = self.hvd
        present = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        compression = hvd.Compression.fp16 if self.strategy.options.compression == "fp16" else hvd.Compression.none
        reduced = hvd.grouped_allreduce(
            [grads[i] for i in present], op=hvd.Average, compression=compression, name="unifit.gradients"
        )
        out = list(grads)
        for i, g in zip(present, reduced):
            out[i] = g
        # an Embedding's gradient stays sparse (Horovod gathers its rows, as MirroredStrategy does): made dense,
        # Adam would also move the rows no sample used (their moments decay), unlike model.fit
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                out[i] = hvd.allreduce(g, op=hvd.Average, name=f"unifit.sparse_gradient.{i}")
        return out

    def broadcast_variables(self, variables: list[Any]) -> None:
        if self.strategy.world_size == 1:
            return
        with self.strategy.collective("broadcast of the initial variables"):
            for i, variable in enumerate(variables):
                value = self.hvd.broadcast(tf.convert_to_tensor(variable), root_rank=0, name=f"unifit.variable.{i}")
                variable.assign(value)
