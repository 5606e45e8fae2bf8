"""How a strategy trains a Keras module: which tf.distribute strategy builds and runs the step,
and the gradient reduction and initial broadcast for strategies that do it themselves (Horovod).
The defaults are one process's."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
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

    def prepare_model(self, model: Any) -> None:
        """Called once the model is built, before any step (nothing by default; parameter-server makes a
        partitioned variable checkpoint as one whole variable)."""

    def whole_variables(self, model: Any) -> AbstractContextManager[None]:
        """While saving the model's weights outside a checkpoint (export), every variable reads as one array
        (parameter-server: a partitioned one is gathered from its shards)."""
        return nullcontext()

    def gradient_targets(self, variables: list[Any]) -> list[Any]:
        """The variables gradients are taken against and the optimizer updates: the model's trainable ones
        (parameter-server: a partitioned variable's shards, which Keras 3 cannot differentiate as one)."""
        return variables

    # ---- how steps run and data reaches them: the default runs here, now; parameter-server schedules them
    per_worker_stream = False  # True: each worker reads its own endless shuffled stream of the training data
    precisions: tuple[str, ...] | None = None  # the trainer.precision values it trains in (None: every one)

    def distribute(self, dist: Any, dataset_fn: Any, training: bool) -> Any:
        """The dataset the step reads: distributed over this process's replicas by `dist`."""
        return dist.distribute_datasets_from_function(dataset_fn)

    def run_step(self, step: Any, argument: Any) -> Any:
        """Run the compiled step (its batch or iterator): here, at once."""
        return step(argument)

    def fetch(self, value: Any) -> Any:
        """A step output as a value (one that ran elsewhere is brought here)."""
        return value

    def wait_for_steps(self, what: str) -> None:
        """Every step run so far is done before `what` (nothing to wait for where steps run here)."""
