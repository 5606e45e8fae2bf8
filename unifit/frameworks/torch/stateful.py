"""torchmetrics Metric objects logged with self.log: computed over every rank's states."""

from __future__ import annotations

from typing import Any

from unifit.errors import ConfigError


def is_torchmetric(value: Any) -> bool:
    return all(hasattr(value, attr) for attr in ("compute", "reset", "dist_sync_fn", "distributed_available_fn"))


class TorchmetricValue:
    """compute() with every rank's states gathered (torchmetrics' own reductions: cat, sum, ...)
    through the strategy's collectives, so it works under Horovod too, not only torch.distributed."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self.name = type(metric).__name__

    def compute_over(self, strategy: Any) -> Any:
        def gather(tensor: Any, group: Any = None) -> list[Any]:
            states = strategy.all_gather_object(tensor.detach().cpu())
            return [t.to(tensor.device) for rank, t in enumerate(states) if strategy.reports_metrics(rank)]

        metric = self.metric
        saved = metric.dist_sync_fn, metric.distributed_available_fn
        metric.dist_sync_fn, metric.distributed_available_fn = gather, (lambda: strategy.world_size > 1)
        try:
            return metric.compute()
        finally:
            metric.dist_sync_fn, metric.distributed_available_fn = saved

    def reset(self) -> None:
        self.metric.reset()

    def state(self) -> dict[str, Any]:
        """The metric's states on the host (a mid-epoch checkpoint)."""
        return {
            name: [t.detach().cpu() for t in value] if isinstance(value, list) else value.detach().cpu()
            for name, value in self.metric.metric_state.items()
        }

    def merge(self, state: dict[str, Any]) -> None:
        """Add a checkpoint's states to the metric's (torchmetrics' merge_state: its own reductions)."""
        device = self.metric.device
        moved = {
            name: [t.to(device) for t in value] if isinstance(value, list) else value.to(device)
            for name, value in state.items()
        }
        try:
            self.metric.merge_state(moved)
        except RuntimeError as exc:
            raise ConfigError(
                f"metric {self.name}: its state from the mid-epoch checkpoint cannot be merged "
                f"({exc}); resume from a checkpoint taken at an epoch end"
            ) from None
