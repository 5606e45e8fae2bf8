"""validate / test / predict for TrainModules (a mixin of TorchEngine; trainer/evaluation.py runs it).

No optimizer and no training data are set up; every rank takes a disjoint shard of the stage's
dataset (ShardSampler: uneven, no padding, so no sample counts twice) and the model needs no
strategy wrapper, since nothing is reduced but the logged metrics and the gathered predictions.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence

import torch

from unifit.errors import ConfigError
from unifit.frameworks.torch import combined, input_path, iterable, pruning, user_loaders
from unifit.frameworks.torch import data as tdata
from unifit.strategies.torch_device import torch_device
from unifit.strategies.torch_precision import make_precision
from unifit.strategies.torch_training import TorchTraining

# stage -> (the data provider's method, the module's step)
_STAGES = {
    "validate": ("val_dataset", "validation_step"),
    "test": ("test_dataset", "test_step"),
    "predict": ("predict_dataset", "predict_step"),
}


class TorchEvaluation:
    module: Any
    data: Any
    strategy: Any
    training: TorchTraining
    config: Any
    collector: Any
    _transfer: Any  # the module's way of moving a batch to the device: (batch, dataloader_idx) -> batch, or None
    _position: tuple[int, ...] = (0,)  # the current evaluation batch's (batch_idx, [dataloader_idx])
    _indices: list[list[list[int]]] | None = None  # per loader, per batch: the dataset indices (see setup_evaluation)

    def setup_evaluation(self, stage: str) -> None:
        cfg, strategy = self.config, self.strategy
        self.device = torch_device(cfg.accelerator, strategy.device_index)
        self.precision = make_precision(cfg.precision, self.device)
        self.module.setup_stage(stage)
        self.module.to(self.device)
        self._transfer = self.module.batch_transfer(self.device)
        source, step = _STAGES[stage]
        self._eval_step = getattr(self.module, step)
        dataset, presharded = self._stage_data(stage, source)
        world, rank = (1, 0) if presharded else (strategy.data_parallel_size, strategy.data_parallel_rank)
        if stage == "predict" and iterable.is_stream(dataset):
            raise ConfigError(
                f"{source}(): an IterableDataset has no indices to put predictions in order by; "
                "give a map-style Dataset (with __len__ and __getitem__)"
            )
        several = user_loaders.each_loader(dataset)
        self.eval_loaders = [
            combined.evaluation_loader(
                each,
                f"{source}()",
                batch_size=cfg.batch_size,
                world_size=world,
                rank=rank,
                num_workers=cfg.num_workers,
                pin_memory=self.device.type == "cuda",
            )
            for each in several
        ]
        for loader in self.eval_loaders:
            self._place_on_device(loader, f"{source}()")
        self._limit = cfg.limit_val_batches if stage == "validate" else None
        # each batch's dataset indices, for a module that records them (a LightningModule's prediction writers)
        self._indices = (
            [user_loaders.shard_batches(loader) for loader in self.eval_loaders]
            if stage == "predict" and getattr(self.module, "records_batch_indices", False)
            else None
        )
        self._same_weights_everywhere()

    def _same_weights_everywhere(self) -> None:
        """Rank 0's weights on every rank, as fit starts (a checkpoint's, loaded after, are the same anyway). A model
        split over the ranks by its configure_model() (DTensors) took its group's first rank's weights as it split."""
        if self.strategy.world_size > 1 and not any(hasattr(p, "device_mesh") for p in self.module.parameters()):
            state = self.strategy.broadcast_object(
                {k: v.cpu() for k, v in self.module.state_dict().items()} if self.strategy.is_global_zero else None
            )
            self.module.load_state_dict(state)

    def _rank_zero_buffers(self) -> None:
        """Rank 0's buffers (BatchNorm's running statistics) on every rank before validation, so every rank
        validates the model rank 0 checkpoints: each rank's buffers followed its own batches (DDP copies rank
        0's only as a training step starts, FSDP and Horovod never)."""
        if self.strategy.world_size == 1:
            return
        owner = getattr(self.module, "state_module", self.module)  # a LightningModule's own keys
        names = {name for name, _ in owner.named_buffers()}
        self.strategy.copy_from_rank_zero({k: v for k, v in owner.state_dict().items() if k in names})

    def load_weights(self, state: dict[str, Any]) -> None:
        """The checkpoint's model, whole on every rank (one written sharded by fsdp is read whole too); a pruned
        model's weights folded for a module built unpruned (frameworks/torch/pruning.py)."""
        if "model" in state:
            state = {**state, "model": pruning.folded(self.module.state_module, state["model"])}
        self.training.load_training_state(self.module, None, state, self.config.storage_options)

    def eval_batches(self) -> Iterator[Any]:
        yield from self._batches_of(self.eval_loaders, self._limit)

    def _batches_of(self, loaders: list[Any], limit: int | None) -> Iterator[Any]:
        """Each loader's batches in turn, on the device; `_position` is the step's (batch_idx, [dataloader_idx])
        for the batch just yielded: the index within its loader, and which loader when there are several."""
        for index, loader in enumerate(loaders):
            batches = loader if limit is None else itertools.islice(loader, limit)
            for i, batch in enumerate(input_path.on_device(batches, loader, self._transfer, self.device, index)):
                self._position = (i,) if len(loaders) == 1 else (i, index)
                yield batch

    def _place_on_device(self, loader: Any, what: str) -> None:
        """In-memory data onto the GPU where trainer.data_on_device says so (input_path.place_on_device); each
        loader of a combination on its own."""
        cfg = self.config
        if not hasattr(self, "_placed"):
            self._placed: dict[tuple[str, int], bool] = {}
        decided = self._placed  # loaders made again (at a new batch size) are placed as the first ones were
        for i, each in enumerate(getattr(loader, "loaders", [loader])):
            dataset = getattr(each, "dataset", None)
            setting = decided.get((what, i), cfg.data_on_device)
            decided[(what, i)] = input_path.place_on_device(dataset, self.device, setting, cfg.num_workers, what)
            if decided[(what, i)]:
                each.pin_memory = False  # its batches are on the device already

    def eval_indices(self, loader: int = 0) -> Sequence[int]:
        return user_loaders.shard_indices(self.eval_loaders[loader])

    @property
    def eval_loader(self) -> int:
        """Which loader the batch just yielded came from."""
        return self._position[1] if len(self._position) > 1 else 0

    @property
    def eval_loader_count(self) -> int:
        return len(self.eval_loaders)

    def eval_step(self, batch: Any, batch_idx: int) -> Any:
        """As validation_step: the position within the batch's loader (and which loader)."""
        self.collector.batch_count = tdata.batch_size_of(batch)
        if self._indices is not None:
            self.module.batch_indices = self._indices[self.eval_loader][self._position[0]]
        with torch.no_grad(), self.precision.autocast():
            return self._eval_step(batch, *self._position)

    def unbatch(self, outputs: Any) -> list[Any]:
        """One output per sample: tensors split along the batch dimension (tuples and dicts of them too)."""
        if isinstance(outputs, torch.Tensor):
            return list(outputs.detach().cpu().unbind(0))
        if isinstance(outputs, (tuple, list)):
            return [type(outputs)(parts) for parts in zip(*(self.unbatch(o) for o in outputs))]
        if isinstance(outputs, dict):
            columns = {k: self.unbatch(v) for k, v in outputs.items()}
            return [dict(zip(columns, row)) for row in zip(*columns.values())]
        raise ConfigError(
            f"predict_step returned a {type(outputs).__name__}; return a tensor (one row per sample), "
            "or a tuple or dict of them"
        )

    def collate(self, samples: list[Any]) -> Any:
        """The samples stacked back into batch-first tensors (of tuples and dicts alike)."""
        if not samples:
            return []
        first = samples[0]
        if isinstance(first, torch.Tensor):
            return torch.stack(samples)
        if isinstance(first, (tuple, list)):
            return type(first)(self.collate(list(part)) for part in zip(*samples))
        return {k: self.collate([s[k] for s in samples]) for k in first}
