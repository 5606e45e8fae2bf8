"""Runs a TrainModule: DDP-ready step wrapper, accumulation, clipping, warmup, checkpoints."""

from __future__ import annotations

import copy
import functools
import io
import itertools
import logging
import math
import traceback
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

from unifit.errors import ConfigError, first_line
from unifit.frameworks.base import Engine
from unifit.frameworks.lr_policy import LRPolicy
from unifit.frameworks.rng import host_rng_state, seed_host, set_host_rng_state
from unifit.frameworks.torch import batch_size_finder, combined, input_path, iterable, lr_finder, pruning, user_loaders
from unifit.frameworks.torch import data as tdata
from unifit.frameworks.torch.evaluation import TorchEvaluation
from unifit.frameworks.torch.module import restore_modes, training_modes
from unifit.frameworks.torch.optimizers import parse_optimizers, scale_lrs
from unifit.frameworks.torch.step_seams import STEP_HOOKS, StepSeams, _has_gradients, _loss_of
from unifit.strategies import sharded_state
from unifit.strategies.block_compile import CompileReport
from unifit.strategies.torch_device import torch_device
from unifit.strategies.torch_precision import Precision, make_precision
from unifit.strategies.torch_training import TorchTraining

log = logging.getLogger("unifit")


class _StepModule(torch.nn.Module):
    """Routes training_step through forward(), so DDP's forward hooks see every step (and FSDP's
    gather the parameters for validation_step too)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, batch_idx: int, *more: Any, step: str = "training_step") -> Any:
        return getattr(self.module, step)(batch, batch_idx, *more)


class TorchEngine(TorchEvaluation, Engine):
    # what setup() makes, in one place: the device and precision, the loaders and their sizes, the
    # wrapped step and optimizer, the schedule and lr policy, and the step counters
    device: torch.device
    precision: Precision
    train_loader: Any
    val_loaders: list[Any]  # one per validation loader (a LightningModule may return several)
    wrapped: Any  # the module to call for a step, wrapped by the strategy (DDP, FSDP)
    optimizer: Any  # automatic optimization's one optimizer (manual: the first)
    optimizers: list[Any]  # every optimizer configure_optimizers() returned, wrapped by the strategy
    schedules: list[Any]  # every schedule configure_optimizers() returned (SchedulerSpec)
    stepped: list[Any]  # the schedules unifit steps: all of them (manual optimization: none, the module does)
    seams: StepSeams  # the step opened to the module (self.optimizers(), manual optimization, step hooks)
    _seamed: bool  # the module takes part in the step: it runs through the seams
    policy: LRPolicy
    accumulate: int
    _stream: bool  # the training data is an iterable stream
    _sizes: Any
    _batches: int  # training batches per epoch on this rank
    _forward: Any  # training_step, through the wrapper (and torch.compile) where needed
    _validate: Any
    _plain: bool  # the strategy's default step in full precision: the fast path
    _plain_groups: int  # the optimizer's param groups when the fast path was chosen
    _steps: int  # optimizer steps taken
    _epoch: int  # the epoch being trained (the step hooks' argument)
    _epochs_done: int

    def setup(self) -> None:
        cfg, strategy = self.config, self.strategy
        self.device = torch_device(cfg.accelerator, strategy.device_index)
        if cfg.class_weight:
            raise ConfigError(
                "trainer.class_weight: model.fit's option for Keras models; for a PyTorch module weigh the classes in "
                "the loss (torch.nn.functional.cross_entropy(..., weight=...))"
            )
        self.precision = make_precision(cfg.precision, self.device)
        self.module.fit_config = cfg
        self.module.setup_stage("fit")
        self.module.to(self.device)
        if not self.module.state_module.training:  # as Lightning, unifit keeps the module's own modes
            log.warning(
                "%s is in eval mode at the start of training (dropout off, BatchNorm statistics frozen); "
                "call .train() on it first if that is not meant",
                type(self.module.state_module).__name__,
            )
        self._transfer = self.module.batch_transfer(self.device)
        self._epochs_done = 0
        self._scheduled_epoch = -1  # the last epoch whose epoch-interval schedule has stepped
        self._mid_window = False  # the last micro-batch did not step: gradients are being accumulated

        self._given_config = self.config  # before this fit's sizes are taken: a new batch size starts from it
        self.found_batch_size: tuple[int, str] | None = None  # (size, module attribute): the batch size finder's
        self._setup_data()
        cfg = self.config
        self.accumulate = cfg.accumulation_at(0)  # the epoch's (train_batches sets it where it changes)
        manual = not getattr(self.module, "automatic_optimization", True)
        if manual:
            _check_manual(cfg, _name(self.module))
        self.module.stepping_batches = self._fit_length(self._steps_in)  # known before configure_optimizers
        cfg = self.module.fit_config = self.config  # max_steps: with the epochs it spans
        hooks = self.module.step_hooks()
        self.optimizers, self.schedules = parse_optimizers(
            _configure_optimizers(self.module), _name(self.module), manual, "lr_scheduler_step" in hooks
        )
        self._apply_lr_policy(scaled_by=1.0)
        self._steps = 0
        training = self.training
        step_module = _StepModule(self.module)
        for line in training.prepare_blocks(self.module.state_module, cfg):  # checkpointing, compiling per block
            if strategy.is_global_zero:
                log.info(line)
        self._compile_report = CompileReport() if cfg.compile == "blocks" else None
        if manual:
            self.wrapped, self.optimizers = training.setup_manual(
                step_module, self.optimizers, self.device, self.precision
            )
        else:
            self.wrapped, optimizer = training.setup_module_and_optimizer(  # the longest accumulation window
                step_module, self.optimizers[0], self.device, self.precision, max(cfg.accumulations())
            )
            if optimizer is not self.optimizers[0]:
                for spec in self.schedules:  # same param groups; the schedulers follow the wrapper
                    spec.scheduler.optimizer = optimizer
            self.optimizers = [optimizer]
        self.optimizer = self.optimizers[0]
        self.stepped = [] if manual else list(self.schedules)
        self.seams = StepSeams(self, manual, hooked=bool(hooks & set(STEP_HOOKS)))
        self._seamed = manual or self.seams.hooked  # the step runs through the seams, with the module's parts
        self.module.bind_steps(self.seams)
        # unwrapped (one process): call training_step directly, without nn.Module.__call__'s cost
        unwrapped = type(self.wrapped) is _StepModule
        self._forward = self.module.training_step if unwrapped else self.wrapped
        self._validate = (
            functools.partial(self.wrapped, step="validation_step")
            if training.routes_all_steps
            else self.module.validation_step
        )
        if cfg.compile is True:  # the whole step ("blocks": each block, above)
            self._forward = _compiled(self._forward)
        # what TorchTraining's default step amounts to in full precision without accumulation or
        # clipping: loss.backward(), optimizer.step(), zero_grad(), called without its layers
        self._plain = (
            not self._seamed
            and type(self.precision) is Precision
            and cfg.accumulations() == {1}
            and cfg.gradient_clip_val is None
            and all(
                getattr(type(training), hook) is getattr(TorchTraining, hook)
                for hook in ("backward", "synchronized_gradients", "optimizer_step")
            )
            # a frozen parameter in the optimizer may be unfrozen later: the strategy's step averages it then
            and all(p.requires_grad for group in self.optimizer.param_groups for p in group["params"])
        )
        self._plain_groups = len(self.optimizer.param_groups)  # one added later (finetuning): the strategy's step

    def _setup_data(self) -> None:
        """The loaders at this fit's batch size, and the sizes that follow from it (called again by resize())."""
        cfg, strategy = self.config, self.strategy
        pin = self.device.type == "cuda"
        train, presharded = self._rank_data(self.data.train_dataset())
        cfg = self.config = self._adopt_batch_size(train)
        shards = (1, 0) if presharded else (strategy.data_parallel_size, strategy.data_parallel_rank)
        self._stream = iterable.is_stream(train)
        # an endless stream trained by steps: one epoch of max_steps (Lightning's)
        limit = cfg.limit_train_batches or (cfg.max_steps and cfg.max_steps * max(cfg.accumulations()))
        if self._stream:  # an IterableDataset: batches dealt to ranks and workers (iterable.py)
            self.train_loader = iterable.stream_loader(
                train,
                "train_dataset()",
                batch_size=cfg.batch_size,
                world_size=shards[0],
                rank=shards[1],
                train=True,
                limit=limit,
                num_workers=cfg.num_workers,
                pin_memory=pin,
            )
        else:  # a map-style dataset, the user's own DataLoader (its settings kept, its sampling sharded), or several
            options = dict(
                batch_size=cfg.batch_size,
                world_size=shards[0],
                rank=shards[1],
                seed=cfg.seed,
                drop_last=cfg.drop_last,
                num_workers=cfg.num_workers,
                pin_memory=pin,
            )
            if isinstance(train, combined.Combined):  # several loaders, a batch of each per step (Lightning's)
                self.train_loader = combined.shard(train, limit=limit or None, **options)
            else:
                what = "train_dataloader()" if user_loaders.is_loader(train) else "train_dataset()"
                self.train_loader = user_loaders.train_loader_for(train, what, **options)
        self._place_on_device(self.train_loader, "train_dataset()")
        train_ds = self.train_loader.dataset
        self._batches = len(self.train_loader)
        if cfg.limit_train_batches:
            self._batches = min(self._batches, cfg.limit_train_batches)
        if presharded:  # shards sharded by file differ in size: every rank takes the smallest's steps
            self._batches = -int(strategy.all_reduce_max(np.array([-self._batches]))[0])
        if self._batches == 0:
            raise ConfigError(
                f"trainer.batch_size: {cfg.batch_size} with drop_last leaves no training batch on rank "
                f"{strategy.rank} ({len(train_ds)} samples over {strategy.data_parallel_size} replicas); lower batch_size"
            )
        has_val_step = type(self.module).validation_step is not _base_validation_step()
        val, val_presharded = self._rank_data(self.data.val_dataset() if has_val_step else None)
        self.val_loaders = []
        if val is not None and cfg.limit_val_batches != 0:
            shards = (1, 0) if val_presharded else (strategy.data_parallel_size, strategy.data_parallel_rank)
            self.val_loaders = [
                combined.evaluation_loader(
                    each,
                    "val_dataset()",
                    batch_size=cfg.batch_size,
                    world_size=shards[0],
                    rank=shards[1],
                    num_workers=cfg.num_workers,
                    pin_memory=pin,
                )
                for each in user_loaders.each_loader(val)
            ]
            for loader in self.val_loaders:
                self._place_on_device(loader, "val_dataset()")

        # samples per batch, known at set-up (a batch sampler of the user's may vary them: read from each batch)
        self._sizes: tuple[int, int] | None = (
            (cfg.batch_size,) * 2
            if self._stream
            else None
            if self.train_loader.batch_size is None
            else tdata.batch_sizes(self.train_loader, self._batches)
        )

    def resize(self, batch_size: int, source: str) -> None:
        """Train at `batch_size` from here on (the batch size finder's trials and result, a resume of its run): the
        loaders made again, and what follows from their length (the fit's steps, warmup, the lr scaling)."""
        self.config = self._given_config.adopting_batch_size(batch_size, source)
        self._setup_data()  # a DataLoader of the module's own brings its batch size: the finder checks it followed
        if self.config.batch_size == batch_size:
            self.config = self.config.adopting_batch_size(batch_size, source)
        self.module.stepping_batches = self._fit_length(self._steps_in)
        self.module.fit_config = self.config
        self._apply_lr_policy(scaled_by=self.policy.factor)  # lr_scaling by a base_batch_size: lrs follow the size

    def _apply_lr_policy(self, scaled_by: float) -> None:
        """The lr policy of the fit's config and length; the optimizers' lrs (and their schedules' bases), now
        scaled by `scaled_by`, rescaled to its factor."""
        self.policy = LRPolicy.from_config(self.config, self.replicas, self._steps_in)
        for optimizer in self.optimizers:
            schedules = [s.scheduler for s in self.schedules if _schedules(s, optimizer)]
            scale_lrs(optimizer, schedules, self.policy.factor / scaled_by)

    def _steps_in(self, epoch: int) -> int:
        """Optimizer steps in `epoch` (its accumulation's: trainer.accumulation_schedule may change it)."""
        return math.ceil(self._batches / self.config.accumulation_at(epoch))

    def find_batch_size(self, settings: Any) -> Any:
        return batch_size_finder.find_batch_size(self, settings)

    def _adopt_batch_size(self, train: Any) -> Any:
        """The run's config, with the training DataLoader's batch size when trainer.batch_size was not set."""
        cfg = self.config
        if isinstance(train, combined.Combined):  # several loaders: the first one's batch size is the run's
            train = train.loaders[0]
        loader = train if user_loaders.is_loader(train) else None
        if loader is None:
            return cfg
        if loader.batch_size is None and loader.batch_sampler is None and not iterable.is_stream(loader):
            raise ConfigError(
                "train_dataloader(): the DataLoader has batch_size=None (its dataset gives whole "
                "batches), so unifit cannot shard it by sample; give the DataLoader a batch_size"
            )
        if user_loaders.loader_batch_size(loader) is None and iterable.is_stream(loader):
            return cfg  # a stream the loader does not batch: unifit batches it by trainer.batch_size
        size = user_loaders.check_batch_size(
            loader, "train_dataloader()", cfg.batch_size if cfg.batch_size_given else None
        )
        return (
            cfg
            if size == cfg.batch_size and cfg.batch_size_given
            else cfg.adopting_batch_size(size, "the training DataLoader")
        )

    def close(self) -> None:
        super().close()
        self.module.bind_steps(None)
        self.training.gradient_hooks = None

    # ---- facts ------------------------------------------------------------------------
    @property
    def batches_per_epoch(self) -> int:
        return self._batches

    @property
    def has_validation(self) -> bool:
        return bool(self.val_loaders)

    @property
    def threads(self) -> int:
        return torch.get_num_threads()

    @property
    def validates_mid_accumulation(self) -> bool:
        return bool(self.training.validates_mid_accumulation)

    @property
    def forks_loader_workers_each_epoch(self) -> bool:
        loaders = getattr(self.train_loader, "loaders", [self.train_loader])  # a combination's, or the one
        return any(getattr(x, "num_workers", 0) > 0 and not getattr(x, "persistent_workers", False) for x in loaders)

    @property
    def optimizer_steps(self) -> int:
        return self._steps

    # ---- training -----------------------------------------------------------------------
    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        self._epoch = epoch  # the module's modes are its own, as in Lightning (validation gives them back)
        self.accumulate = self.config.accumulation_at(epoch)
        if self._stream:  # a stream skips whole batches; a sampler skips sample indices
            self.train_loader.dataset.set_epoch(epoch, skip)
        elif isinstance(self.train_loader, combined.CombinedTrainLoader):
            self.train_loader.set_epoch(epoch, skip)
        else:
            user_loaders.set_epoch(self.train_loader, epoch, skip)
        # worker seeds per rank and epoch, from the loader's own generator (the global RNG stays untouched)
        self.train_loader.generator.manual_seed(
            self.config.seed * 1_000_003 + self.strategy.data_parallel_rank * 10_007 + epoch
        )
        batches = itertools.islice(self.train_loader, self._batches - skip)  # the loader's own iterator, no layer
        return input_path.on_device(batches, self.train_loader, self._transfer, self.device)

    def train_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        # the sampler's batch sizes, known at set-up: the step need not look into the batch
        sizes = self._sizes
        count = (sizes[0] if batch_idx + 1 < self._batches else sizes[1]) if sizes else tdata.batch_size_of(batch)
        self.collector.batch_count = count
        accumulate = self.accumulate
        loss: torch.Tensor | None
        if self.module.forward_only:  # the module's statistics (BatchNorm's) see the batch; nothing is trained
            with self.training.accumulating(self.wrapped), self.precision.autocast():
                out = self._forward(batch, batch_idx)
            loss = None if out is None else _loss_of(out)
            accumulate = 1
        elif self._plain:
            out = self._forward(batch, batch_idx)
            loss = None if out is None else _loss_of(out)
            if loss is not None:
                loss.backward()
            self._optimizer_step(taken=loss is not None or _has_gradients(self.optimizer))
        elif self._seamed:  # manual optimization, or the module's hooks inside the step
            loss = self.seams.train_step(batch, batch_idx, self._epoch)
        elif accumulate == 1 or (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == self._batches:
            loss = self._forward_backward(batch, batch_idx)
            self._optimizer_step(taken=loss is not None or _has_gradients(self.optimizer))
        else:
            with self.training.accumulating(self.wrapped):
                loss = self._forward_backward(batch, batch_idx)
        last = batch_idx + 1 == self._batches
        if last:  # as Lightning: the epoch's schedule steps in its last batch
            self._epoch_schedule()
        self._mid_window = accumulate != 1 and (batch_idx + 1) % accumulate != 0 and not last
        if loss is None:  # a skipped batch (training_step returned None, one process only): no loss to count
            return None
        loss = loss.detach()  # kept as a tensor, on CPU too (one code path): read once at epoch end, no sync per step
        self.collector.add("train/loss", loss, count)
        self.collector.count_samples(count)
        return loss

    def _forward_backward(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        with self.precision.autocast():
            out = self._forward(batch, batch_idx)
        if out is None:  # a skipped batch: no backward (one process only; the module's adapter refuses it otherwise)
            return None
        loss = _loss_of(out)
        self.training.backward(loss / self.accumulate if self.accumulate != 1 else loss)
        return loss

    def _optimizer_step(self, taken: bool = True) -> None:
        """The strategy steps; during warmup at the ramped lr (the user's scheduler keeps its own values).
        Not `taken` (every batch of the window was skipped, so no gradient): the step counts, as in Lightning,
        and the schedules step, but the optimizer does not (a loss scaler has nothing to unscale)."""
        optimizer, step = self.optimizer, self._steps
        warmup = taken and step < self.policy.warmup_steps
        if warmup:
            ramp = self.policy.ramp(step)
            scheduled = [group["lr"] for group in optimizer.param_groups]
            for group, lr in zip(optimizer.param_groups, scheduled):
                group["lr"] = lr * ramp
        if self._plain and len(optimizer.param_groups) != self._plain_groups:
            self._plain = False  # a param group added mid-training: its gradients need the strategy's averaging
        if not taken:
            pass
        elif self._plain:
            optimizer.step()
            optimizer.zero_grad()
        else:
            self.training.optimizer_step(optimizer, self.module, self.config.gradient_clip_val)
        if warmup:
            for group, lr in zip(optimizer.param_groups, scheduled):
                group["lr"] = lr
        self._steps = step + 1
        for schedule in self.stepped:
            if schedule.interval == "step" and self._steps % schedule.frequency == 0:
                self.module.lr_scheduler_step(schedule.scheduler, None)

    def end_of_epoch(self) -> None:
        self._epoch_schedule()  # an epoch that ended early (max_steps, a stop) steps its schedule here
        if self._mid_window:  # ended inside an accumulation window (on_train_batch_start returned -1): as
            for optimizer in self.optimizers:  # Lightning, the next epoch starts from zero gradients
                optimizer.zero_grad()
            self._mid_window = False
        self._epochs_done += 1
        line = self._compile_report.line() if self._compile_report is not None else None
        if line is not None and self.strategy.is_global_zero:
            log.info(line)

    def _epoch_schedule(self) -> None:
        """The epoch-interval schedules step once per epoch, after the epoch's last optimizer step."""
        if self._scheduled_epoch == self._epochs_done:
            return
        self._scheduled_epoch = self._epochs_done
        for schedule in self.stepped:
            if (
                schedule.interval == "epoch"
                and not schedule.monitor
                and (self._epochs_done + 1) % schedule.frequency == 0
            ):
                self.module.lr_scheduler_step(schedule.scheduler, None)

    def epoch_metrics(self, metrics: dict[str, float], validated: bool) -> None:
        """A monitored scheduler (ReduceLROnPlateau) steps on the epoch's reduced metrics, identical
        on every rank; on epochs without validation a validation metric is not there, so it waits."""
        for schedule in self.stepped:
            if not schedule.monitor or self._epochs_done % schedule.frequency:
                continue
            if schedule.monitor in metrics:
                self.module.lr_scheduler_step(schedule.scheduler, metrics[schedule.monitor])
            elif validated or not self.has_validation:
                raise ConfigError(
                    f"{_name(self.module)}.configure_optimizers(): the scheduler monitors "
                    f"'{schedule.monitor}', which was not logged; logged metrics: {sorted(metrics)}"
                )

    def current_lrs(self) -> list[float]:
        ramp = self.policy.ramp(self._steps)
        return [group["lr"] * ramp for group in self.optimizer.param_groups]

    # ---- validation ---------------------------------------------------------------------
    @contextmanager
    def validating(self) -> Iterator[None]:
        """Lightning's order around a validation inside fit: gradients released, the model in eval mode (the
        module's hooks), then each submodule's mode from before restored, or the module's own hook."""
        module = self.module
        modes = training_modes(module)  # a frozen part in eval mode stays so
        if not self._mid_window:  # the gradients being accumulated stay (Lightning's order)
            module.on_validation_model_zero_grad()
        module.on_validation_model_eval()
        self._rank_zero_buffers()
        with self.separate_metrics(), self.training.evaluating(self.wrapped, self._uneven_validation()):
            yield
        if module.overrides_model_train():
            module.on_validation_model_train()
        else:
            restore_modes(modes)

    def _uneven_validation(self) -> bool:
        """Whether the ranks take different numbers of validation batches (the shards are uneven, no sample counted
        twice), where the strategy's forward is a collective (fsdp). A stream without a length may differ."""
        if not self.training.routes_all_steps:
            return False
        limit = self.config.limit_val_batches
        try:
            count = sum(min(len(loader), limit or len(loader)) for loader in self.val_loaders)
        except TypeError:  # an IterableDataset without __len__
            return True
        most, fewest = self.strategy.all_reduce_max(np.array([count, -count], dtype=np.float64))
        return bool(most != -fewest)

    def val_batches(self) -> Iterator[Any]:
        yield from self._batches_of(self.val_loaders, self.config.limit_val_batches)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """`batch_idx` counts within the batch's loader (and the step gets its `dataloader_idx` when there are
        several), as val_batches yielded it."""
        self.collector.batch_count = tdata.batch_size_of(batch)
        with torch.no_grad(), self.precision.autocast():
            self._validate(batch, *self._position)

    # ---- numbers ------------------------------------------------------------------------
    def to_numpy(self, values: list[Any]) -> np.ndarray:
        if values and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in values):
            return torch.stack(values).double().cpu().numpy()  # one op, one device sync
        if values and all(isinstance(v, torch.Tensor) for v in values):
            return torch.stack([v.double().reshape(-1).mean() for v in values]).cpu().numpy()
        return np.asarray([float(v) for v in values], dtype=np.float64)

    def is_finite(self, value: Any) -> bool:
        if isinstance(value, torch.Tensor):  # a loss: one .item(), not isfinite + all + bool
            return math.isfinite(value.item()) if value.numel() == 1 else bool(torch.isfinite(value).all())
        return math.isfinite(value)

    def finite_probe(self, value: Any) -> Any:
        """On CUDA: a non-blocking copy of the flag to pinned memory, read once its event completed."""
        if not (isinstance(value, torch.Tensor) and value.is_cuda):
            return super().finite_probe(value)
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(torch.isfinite(value).all(), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return lambda: bool(host) if done.query() else None

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **self.training.training_state(self.module, self._optimizer_state_target()),  # (shards, where sharded)
            "schedulers": [s.scheduler.state_dict() for s in self.schedules],
            "param_groups": self._param_group_names(),
            **self._manual_state(),
            "optimizer_steps": self._steps,
            "epochs_done": self._epochs_done,
            "scheduled_epoch": self._scheduled_epoch,  # a checkpoint in an epoch's last batch: its schedule stepped
            "precision": self.precision.state_dict(),
            "lr_factor": self.policy.factor,  # the world size's lr scaling the saved lrs include
            **({"found_batch_size": list(self.found_batch_size)} if self.found_batch_size else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get(
            "found_batch_size"
        ):  # the batch size finder's run goes on at its size (the module's attribute too)
            size, attribute = state["found_batch_size"]
            batch_size_finder.adopt(self, int(size), str(attribute))
            log.info("resume: batch size %d, as the batch size finder found it for this run", int(size))
        pruning.prune_like(self.module.state_module, state.get("model", {}))  # a pruned model's masks, resumed
        self._restore_param_groups(state.get("param_groups", []))
        self.training.load_training_state(
            self.module, self._optimizer_state_target(), state, self.config.storage_options
        )
        # "scheduler": the one schedule of a checkpoint written before several were taken
        saved = state.get("schedulers") or ([state["scheduler"]] if state.get("scheduler") is not None else [])
        for spec, scheduler_state in zip(self.schedules, saved):
            spec.scheduler.load_state_dict(scheduler_state)
        if self._is_manual():
            self.seams.steps_taken = list(state.get("steps_taken", self.seams.steps_taken))
        self._steps = int(state["optimizer_steps"])
        self._epochs_done = int(state.get("epochs_done", 0))
        self._scheduled_epoch = int(state.get("scheduled_epoch", self._epochs_done - 1))
        self.precision.load_state_dict(state.get("precision", {}))
        saved_factor = state.get("lr_factor", self.policy.factor)
        if saved_factor != self.policy.factor:  # resumed on another world size: the lrs follow its scaling
            for optimizer in self.optimizers:
                schedulers = [s.scheduler for s in self.schedules if _schedules(s, optimizer)]
                scale_lrs(optimizer, schedulers, self.policy.factor / saved_factor)
            log.info(
                "resume: learning rates rescaled x%g (lr scaling %g when saved, %g now)",
                self.policy.factor / saved_factor,
                saved_factor,
                self.policy.factor,
            )

    def _param_group_names(self) -> list[list[list[str]]]:
        """Each optimizer's param groups as parameter names: a group added during training (a finetuning callback
        unfreezing a backbone) is made again before a resume loads the optimizer's state."""
        names = {id(p): name for name, p in self.module.state_module.named_parameters()}
        return [[[names.get(id(p), "") for p in g["params"]] for g in o.param_groups] for o in self.optimizers]

    def _restore_param_groups(self, saved: list[list[list[str]]]) -> None:
        """The groups a checkpoint's optimizers had beyond the ones configure_optimizers() makes, their parameters
        trainable again (the hyperparameters come with the optimizer's state, loaded next)."""
        named = dict(self.module.state_module.named_parameters())
        for optimizer, groups in zip(self.optimizers, saved):
            for names in groups[len(optimizer.param_groups) :]:
                params = [named[name] for name in names]
                for param in params:
                    param.requires_grad_(True)
                optimizer.add_param_group({"params": params})

    def _is_manual(self) -> bool:
        return self.seams.manual

    def _optimizer_state_target(self) -> Any:
        """What the checkpoint's optimizer state is of: the optimizer, or (manual) the list of them."""
        return list(self.optimizers) if self._is_manual() else self.optimizer

    def _manual_state(self) -> dict[str, Any]:
        if not self._is_manual():
            return {}
        return {"steps_taken": self.seams.steps_taken}

    def rng_state(self) -> dict[str, Any]:
        return {
            **host_rng_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def set_rng_state(self, state: dict[str, Any]) -> None:
        set_host_rng_state(state)
        torch.set_rng_state(state["torch"])
        if state["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    def seed(self, seed: int) -> None:
        seed_host(seed)
        torch.manual_seed(seed)

    def find_lr(self, settings: Any) -> Any:
        return lr_finder.find_lr(self, settings)

    # ---- what a tuner (the lr and batch size finders) changes, and puts back --------------------------------------
    @property
    def reads_a_stream(self) -> bool:
        """The training data is an IterableDataset: its loader counts batches, not samples."""
        return self._stream

    def snapshot(self) -> dict[str, Any]:
        """What a sweep or a trial changes, copied to host memory (a copy on the GPU would take memory the trials
        need): weights, optimizer and schedule states, step counters, a loss scaler's scale, the RNG."""
        return _on_host(
            {
                "model": self.module.state_module.state_dict(),
                "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
                "schedulers": [spec.scheduler.state_dict() for spec in self.schedules],
                "counters": (self._steps, self._scheduled_epoch, self._mid_window),
                "steps_taken": list(self.seams.steps_taken),  # manual optimization: each optimizer's own (its warmup)
                "precision": self.precision.state_dict(),
                "rng": self.rng_state(),
            }
        )

    def rewind(self, saved: dict[str, Any]) -> None:
        """Back to a snapshot(), as if the steps since had not been taken (nor their losses logged)."""
        self.module.state_module.load_state_dict(saved["model"])
        for optimizer, state in zip(self.optimizers, saved["optimizers"]):
            optimizer.load_state_dict(state)
            optimizer.zero_grad(set_to_none=True)
        for spec, state in zip(self.schedules, saved["schedulers"]):
            spec.scheduler.load_state_dict(state)
        self._steps, self._scheduled_epoch, self._mid_window = saved["counters"]
        self.seams.steps_taken = list(saved["steps_taken"])
        self.precision.forget_step()
        self.precision.load_state_dict(saved["precision"])
        self.set_rng_state(saved["rng"])
        self.collector.reset()

    def abandon_step(self) -> None:
        """A step that failed midway (out of memory in a trial): its gradients dropped, no window left open."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.precision.forget_step()
        self._mid_window = False

    def start_sharded_write(self, state: dict[str, Any], url: str) -> tuple[dict[str, Any], Future | None]:
        return self.training.start_sharded_write(state, url, self.config.storage_options)

    def checkpoint_files(self, payload: dict[str, Any], writer: bool = True) -> dict[str, bytes]:
        if not writer:
            return {}
        buffer = io.BytesIO()
        torch.save(payload, buffer)  # copies every tensor: later training steps cannot change it
        return {"state.pt": buffer.getvalue()}

    def model_files(self) -> dict[str, bytes]:
        """The whole model; gathered from every rank where it is sharded (so every rank calls this)."""
        state = self.training.full_model_state(self.module)
        if not state:  # a rank other than 0 of a sharded model
            return {}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return {"model.pt": buffer.getvalue()}

    def read_checkpoint(self, fs: Any, directory: str) -> dict[str, Any]:
        data = fs.cat_file(f"{directory}/state.pt")
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        sharded_state.locate(payload["engine"], fs.unstrip_protocol(directory))
        return payload


def _name(module: Any) -> str:
    """The user's class, for messages (a LightningModule's own, not its adapter's)."""
    return type(getattr(module, "lightning", module)).__name__


def _compiled(forward: Any) -> Any:
    """trainer.compile: torch.compile of the step's forward (the strategy's wrapper included)."""
    try:
        return torch.compile(forward)
    except RuntimeError as exc:
        raise ConfigError(f"trainer.compile: torch.compile is not available here ({exc}); set compile: false") from None


def _base_validation_step() -> Any:
    from unifit.frameworks.torch.module import TrainModule

    return TrainModule.validation_step


def _configure_optimizers(module: torch.nn.Module) -> Any:
    """The module's optimizers; torch's own argument checks become config errors."""
    try:
        return module.configure_optimizers()
    except ValueError as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" not in f.filename]
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        raise ConfigError(
            f"{_name(module)}.configure_optimizers() raised ValueError{where}: {first_line(exc)}; check the values it "
            "passes there (the module's init_args, e.g. a negative lr, or what it reads from self.trainer)"
        ) from None


def _check_manual(cfg: Any, name: str) -> None:
    """What Lightning's Trainer refuses with manual optimization, refused alike (the module decides both)."""
    if cfg.accumulations() != {1}:
        raise ConfigError(
            f"trainer.accumulate_grad_batches: received {cfg.accumulation_schedule or cfg.accumulate_grad_batches}, but {name} sets "
            "automatic_optimization = False: accumulate in training_step (step the optimizer every N batches) "
            "and set accumulate_grad_batches: 1"
        )
    if cfg.gradient_clip_val is not None:
        raise ConfigError(
            f"trainer.gradient_clip_val: received {cfg.gradient_clip_val}, but {name} sets "
            "automatic_optimization = False: call self.clip_gradients(opt, gradient_clip_val=..., "
            "gradient_clip_algorithm='norm') in training_step, and remove gradient_clip_val"
        )


def _schedules(spec: Any, optimizer: Any) -> bool:
    return getattr(spec.scheduler, "optimizer", optimizer) is optimizer


def _on_host(value: Any) -> Any:
    """A copy of `value` with its tensors in host memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _on_host(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_host(item) for item in value)
    return copy.deepcopy(value)
