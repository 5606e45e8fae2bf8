"""How a strategy trains a Keras module: which tf.distribute strategy builds and runs the step,
and the gradient reduction and initial broadcast for strategies that do it themselves (Horovod).
The defaults are one process's."""

from __future__ import annotations

from typing import Any


class KerasTraining:
    """How a strategy trains Keras modules: made for a strategy from the registry's table (the plain
    one for single), or the strategy itself where it is built on tf.distribute (mirrored, mwms)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    tf_strategy: Any = None  # a tf.distribute.Strategy; None: TensorFlow's default (one device)

    def reduce_gradients(self, grads: list[Any]) -> list[Any]:
        """Average a replica's gradients across processes, inside the compiled step
        (identity where tf.distribute already does it)."""
        return grads

    def broadcast_variables(self, variables: list[Any]) -> None:
        """Give every process rank 0's values of these variables (no-op by default)."""
