"""The experiment schema: typed, validated by pydantic, the single source of the config reference.

Every option lives in a small model here; `docs/config.md` is generated from these models
(`python -m unifit.cli.config_docs`) and a test fails when the two drift apart.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)


class _Strict(BaseModel):
    """Unknown keys are errors, so a typo never silently becomes a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ClassPath(_Strict):
    """An object built from a dotted class path and keyword arguments."""

    class_path: str = Field(description="Dotted path, e.g. examples.digits.torch_module.DigitsClassifier.")
    init_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the class, checked against its __init__ type hints; a nested {class_path, init_args} is built into an instance.",
    )


class CheckpointConfig(_Strict):
    """Rank-0-only, atomically committed checkpoints with a 'last' pointer."""

    enabled: bool = Field(True, description="Write checkpoints at all.")
    dir: str | None = Field(
        None, description="Where checkpoints go (local path or fsspec URL); default <root_dir>/checkpoints."
    )
    every_n_epochs: PositiveInt = Field(1, description="Save after every N-th epoch (and after the last one).")
    every_n_steps: PositiveInt | None = Field(
        None,
        description="Also save after every N-th optimizer step, mid-epoch included (resumes exactly: the data position, partial epoch metrics and RNG are saved).",
    )
    every_n_minutes: PositiveFloat | None = Field(
        None,
        description="Also save when this many minutes passed since the last save (rank 0's clock, agreed by all ranks every 10 optimizer steps).",
    )
    keep_last_n: PositiveInt | None = Field(
        3,
        description="Keep this many newest checkpoints (the best one and the one resumed from are never deleted); null keeps all.",
    )
    save_on_exception: bool = Field(
        False,
        description="When training fails with an error on one process, first save a checkpoint named on_exception (resumable from the last finished batch; Lightning's OnExceptionCheckpoint). With several ranks the others cannot join a checkpoint's barrier: a warning, and the last committed checkpoint stays the one to resume from.",
    )
    monitor: str | None = Field(None, description="Metric that picks the 'best' checkpoint, e.g. val/acc.")
    mode: Literal["min", "max"] = Field("min", description="Whether a lower or higher `monitor` value is better.")
    keep_best_k: PositiveInt = Field(
        1,
        description="With monitor: also keep the k best checkpoints by it, scored at epoch ends (Lightning's save_top_k), besides the keep_last_n newest.",
    )


class TensorBoardConfig(_Strict):
    """TensorBoard scalars written by rank 0 to a local directory, optionally mirrored to S3 (or any fsspec URL)."""

    enabled: bool = Field(True, description="Write TensorBoard event files.")
    log_dir: str | None = Field(
        None,
        description="Directory for event files; default <root_dir>/tensorboard. A URL (s3://...): written to a temporary local directory and synced there, as sync_to does.",
    )
    log_every_n_steps: PositiveInt = Field(
        50, description="Also write the step loss and lr every N optimizer steps (epoch metrics are always written)."
    )
    sync_to: str | None = Field(
        None, description="Mirror the event files to this URL (e.g. s3://bucket/run/tb) from a background thread."
    )
    sync_every_s: PositiveFloat = Field(
        30.0,
        description="Seconds between background syncs (also synced at every epoch end, at the end and on failure).",
    )
    rotate_mb: PositiveFloat = Field(
        4.0, description="Start a new event file past this size, so a sync never re-uploads a large file."
    )


class TensorBoardLoggerConfig(_Strict):
    """`tensorboard` in trainer.loggers; its options are trainer.tensorboard's."""

    name: Literal["tensorboard"] = Field(description="TensorBoard event files (options: trainer.tensorboard).")


class CSVLoggerConfig(_Strict):
    """metrics.csv as Lightning's CSVLogger writes it (a row per logged step, a column per name, `step` and `epoch`)."""

    name: Literal["csv"] = Field(description="metrics.csv, Lightning's columns.")
    path: str | None = Field(
        None, description="Where the file goes (local or fsspec URL); default <root_dir>/metrics.csv."
    )


class MLflowLoggerConfig(_Strict):
    """An MLflow run: the resolved config as params, every metric at its step, config.yaml (and optionally the last
    checkpoint) as artifacts. Sent from a background thread; an outage is retried and caught up."""

    name: Literal["mlflow"] = Field(description="MLflow tracking.")
    tracking_uri: str | None = Field(
        None,
        description="The tracking server (http://host:5000) or store (sqlite:///path.db); default the MLFLOW_TRACKING_URI environment variable. Credentials come from MLflow's environment (MLFLOW_TRACKING_TOKEN, ...), never from here.",
    )
    experiment: str = Field("unifit", description="MLflow experiment name (created when missing).")
    run_name: str | None = Field(None, description="The run's display name; default MLflow's generated one.")
    tags: dict[str, str] = Field(default_factory=dict, description="Tags set on the run when it is created.")
    log_checkpoints: bool = Field(
        False, description="Upload the last checkpoint as artifacts (checkpoints/<name>) when fit ends."
    )
    flush_timeout_s: PositiveFloat = Field(
        120.0, description="How long the end of the run waits for records still queued (a server that is down)."
    )


class WandbLoggerConfig(_Strict):
    """A Weights & Biases run: the resolved config as its config, every metric at its step."""

    name: Literal["wandb"] = Field(description="Weights & Biases.")
    project: str = Field("unifit", description="W&B project.")
    entity: str | None = Field(None, description="W&B team or user; default your login's.")
    run_name: str | None = Field(None, description="The run's display name.")
    group: str | None = Field(None, description="Group runs together (e.g. one sweep).")
    tags: list[str] = Field(default_factory=list, description="Tags on the run.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="offline writes the run under dir for `wandb sync` later (no network)."
    )
    dir: str | None = Field(None, description="Local directory for wandb's files; default root_dir.")
    log_checkpoints: bool = Field(False, description="Log the last checkpoint as a model artifact when fit ends.")


def _logger_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "class_path" if "class_path" in value else value.get("name")
    return "class_path" if isinstance(value, ClassPath) else getattr(value, "name", None)


LOGGER_MODELS: dict[str, type[BaseModel]] = {
    "tensorboard": TensorBoardLoggerConfig,
    "csv": CSVLoggerConfig,
    "mlflow": MLflowLoggerConfig,
    "wandb": WandbLoggerConfig,
    "class_path": ClassPath,
}
LoggerSpec = Annotated[
    Annotated[TensorBoardLoggerConfig, Tag("tensorboard")]
    | Annotated[CSVLoggerConfig, Tag("csv")]
    | Annotated[MLflowLoggerConfig, Tag("mlflow")]
    | Annotated[WandbLoggerConfig, Tag("wandb")]
    | Annotated[ClassPath, Tag("class_path")],
    Discriminator(_logger_kind),
]


class EarlyStoppingConfig(_Strict):
    """Stop when a monitored metric stops improving (decided identically on every rank)."""

    monitor: str = Field(description="Metric to watch, e.g. val/loss.")
    mode: Literal["min", "max"] = Field("min", description="Whether lower or higher is better.")
    patience: NonNegativeInt = Field(
        3, description="Epochs without improvement before stopping (0: at the first that does not improve)."
    )
    min_delta: NonNegativeFloat = Field(0.0, description="Smallest change that counts as an improvement.")
    strict: bool = Field(
        True, description="A monitor that was not logged is an error (false: that epoch is not checked)."
    )
    check_finite: bool = Field(True, description="Stop as soon as the monitored value is NaN or infinite.")
    stopping_threshold: float | None = Field(
        None, description="Stop as soon as the monitored value is this good (reached or passed, by mode)."
    )
    divergence_threshold: float | None = Field(
        None, description="Stop as soon as the monitored value is worse than this (by mode)."
    )


PreemptionSignal = Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"]


class PreemptionConfig(_Strict):
    """A notice (spot, SLURM's signal before the time limit, submitit's, pod deletion, Ctrl-C) on any rank: every
    rank agrees at a step boundary, one checkpoint is committed, then the handler that was there before unifit's
    (submitit's requeue) runs, and every process exits with 128 + the signal's number."""

    enabled: bool = Field(True, description="Handle the signals below this way (off: Python's default, the run dies).")
    signals: list[PreemptionSignal] = Field(
        ["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"],
        min_length=1,
        description="The notices: SIGTERM (spot instances, Kubernetes, SLURM's --signal=TERM), SIGINT (Ctrl-C), "
        "SIGUSR1 (Lightning's SLURM requeue signal), SIGUSR2 (submitit's). Drop one your own code uses.",
    )
    check_every_n_steps: PositiveInt = Field(
        10, description="Optimizer steps between agreements on whether a rank got a signal (one tiny all-reduce each)."
    )
    checkpoint: bool = Field(True, description="Commit a checkpoint before exiting (needs checkpoint.enabled).")


class ActivationCheckpointingConfig(_Strict):
    """Each block's activations recomputed in backward instead of kept from forward: less memory for more compute
    (PyTorch modules; torchtitan's full and selective modes). `activation_checkpointing: full` is short for
    {mode: full}."""

    mode: Literal["none", "full", "selective"] = Field(
        "none",
        description="full: a block keeps only its input and recomputes the rest in backward; selective: it also "
        "keeps its matrix products and attention outputs (the costly ops), recomputing the cheap ones.",
    )
    every_n_blocks: PositiveInt = Field(
        1,
        description="Only every n-th block (the n-th, 2n-th, ...) is checkpointed; the others keep their activations.",
    )
    blocks: list[str] | None = Field(
        None,
        description="Class names of the blocks (e.g. [GPT2Block]); default: the items of the model's ModuleLists "
        "and Sequentials of layers (its repeated blocks).",
    )


class NanGuardConfig(_Strict):
    """Stop all ranks together when the loss is NaN or infinite, keeping the last good checkpoint."""

    enabled: bool = Field(True, description="Check the loss for NaN/inf.")
    check_every_n_steps: PositiveInt = Field(
        10,
        description="Check (and agree across ranks) every N steps; the epoch's loss is always checked before a checkpoint is written.",
    )


class LRFindConfig(_Strict):
    """Lightning's learning-rate range test (its LearningRateFinder callback, Tuner.lr_find) before the first epoch:
    the lr swept over a few steps, the model and optimizer put back, the lr of the steepest loss descent adopted."""

    min_lr: PositiveFloat = Field(1e-8, description="The sweep's first lr.")
    max_lr: PositiveFloat = Field(1.0, description="The sweep's last lr.")
    num_training_steps: PositiveInt = Field(100, description="Optimizer steps of the sweep.")
    mode: Literal["exponential", "linear"] = Field("exponential", description="How the lr grows step to step.")
    early_stop_threshold: PositiveFloat | None = Field(
        4.0, description="Stop once the smoothed loss exceeds this many times its best (null: never)."
    )
    update_attr: bool = Field(
        True,
        description="Train with the suggested lr (every lr of the optimizers and schedules scaled alike) and set "
        "the module's lr / learning_rate attribute (or attr_name) to it; false: only report it.",
    )
    attr_name: str = Field("", description="The module attribute that holds the lr, when not lr or learning_rate.")


class BatchSizeFindConfig(_Strict):
    """Lightning's batch size finder (its BatchSizeFinder callback, Tuner.scale_batch_size) before the first epoch of a
    fresh fit on one process: trial steps at growing batch sizes until memory runs out, then the fit at the largest
    that fit, everything the trials changed put back."""

    mode: Literal["power", "binsearch"] = Field(
        "power",
        description="power: doubled until a trial runs out of memory, then half that; binsearch: then a binary "
        "search between the last size that fit and the first that did not.",
    )
    steps_per_trial: PositiveInt = Field(3, description="Optimizer steps (and validation batches) of each trial.")
    init_val: PositiveInt = Field(2, description="The first batch size tried.")
    max_trials: PositiveInt = Field(25, description="Trials at most.")
    batch_arg_name: str = Field(
        "batch_size",
        description="The attribute (of the module, its hparams or its data module) its own DataLoaders are built "
        "with; set to each size tried. A LightningModule must have it; unifit's own loaders follow the size anyway.",
    )
    margin: float = Field(
        0.05, ge=0.0, lt=1.0, description="binsearch: the size found is lowered by this share, for headroom."
    )
    max_val: PositiveInt = Field(8192, description="No batch size above this is tried.")


class DeviceStatsConfig(_Strict):
    """Log device statistics with the step values (Lightning's DeviceStatsMonitor, the same keys)."""

    enabled: bool = Field(False, description="Log them (needs a logger).")
    cpu_stats: bool | None = Field(
        None,
        description="Also the host's cpu_percent, cpu_vm_percent and cpu_swap_percent: null, only when training on "
        "CPU; true, always; false, never.",
    )


# Lightning's spellings of the precisions unifit runs (its Trainer takes 32, 16 and bf16 for the same)
PRECISION_SPELLINGS = {
    "32": "32-true",
    "32-true": "32-true",
    "16": "16-mixed",
    "16-mixed": "16-mixed",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
}


class TrainerConfig(_Strict):
    """Everything the Trainer does; `Trainer(**fields)` takes the same names."""

    strategy: str = Field(
        "single",
        description="Distribution strategy: a registered name (single, ddp, smddp-like, fsdp, model-parallel, horovod, mirrored, mwms, parameter-server) or the class path of your own Strategy subclass (pkg.module:MyStrategy), checked when the Trainer is made.",
    )
    strategy_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the chosen strategy, validated by that strategy (see its docs page).",
    )
    accelerator: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="auto uses GPUs when present (one per process, by local rank), else CPU."
    )
    max_epochs: PositiveInt = Field(
        10, description="Number of epochs to train (with max_steps and not set: as many as max_steps takes)."
    )
    max_time: PositiveFloat | None = Field(
        None,
        description="Stop once training has run this long, in seconds or Lightning's 'DD:HH:MM:SS' (counted across resumes; checked every preemption.check_every_n_steps steps); validated and checkpointed there.",
    )
    max_steps: PositiveInt | None = Field(
        None,
        description="Stop after this many optimizer steps, mid-epoch if need be (validated and checkpointed there); with max_epochs, whichever comes first.",
    )
    batch_size: PositiveInt = Field(
        32,
        description="Batch size per replica; the global batch is batch_size x world size x accumulate_grad_batches. When not set, a training DataLoader of the module's own gives its batch size (else 32).",
    )
    base_batch_size: PositiveInt | None = Field(
        None, description="Batch size the module's learning rates were tuned for; default: batch_size (one replica)."
    )
    lr_scaling: Literal["linear", "sqrt", "none"] = Field(
        "linear",
        description="Multiply the base lr by global/base batch (linear), its square root (sqrt), or not at all.",
    )
    warmup_epochs: NonNegativeFloat = Field(
        0.0, description="Ramp the lr linearly from base to scaled over this many epochs (per optimizer step)."
    )
    warmup_steps: NonNegativeInt | None = Field(
        None, description="The same in optimizer steps; do not combine with warmup_epochs."
    )
    precision: Literal["32-true", "bf16-mixed", "16-mixed"] = Field(
        "32-true",
        description="Numerics of the step (Lightning's names; its 32, 16 and bf16 are taken too): 32-true, bf16-mixed (autocast / Keras mixed_bfloat16), 16-mixed (float16 with dynamic loss scaling).",
    )
    compile: bool | Literal["blocks"] = Field(
        False,
        description="Compile the step: torch.compile for PyTorch modules, XLA (jit_compile) for Keras modules "
        "(true, or 'step'); 'blocks': each of a PyTorch model's blocks compiled on its own (the blocks of "
        "activation_checkpointing), the form that composes with fsdp and activation checkpointing.",
    )
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig,
        description="See ActivationCheckpointingConfig: none, full or selective, e.g. `activation_checkpointing: full`.",
    )
    accumulate_grad_batches: PositiveInt = Field(1, description="Micro-batches per optimizer step.")
    accumulation_schedule: dict[NonNegativeInt, PositiveInt] | None = Field(
        None,
        description="Accumulation that changes during the fit (Lightning's GradientAccumulationScheduler): epoch (from 0) -> accumulate_grad_batches from that epoch on, e.g. {0: 8, 4: 4, 8: 1}; epochs before the first key accumulate 1. Instead of accumulate_grad_batches; PyTorch modules with automatic optimization.",
    )
    gradient_clip_val: PositiveFloat | None = Field(
        None, description="Clip the global gradient norm to this value before each optimizer step."
    )
    seed: int = Field(
        0, description="Seeds model init (same on every rank), data order, and per-rank randomness (seed + rank)."
    )
    root_dir: str = Field(
        "runs/default",
        description="Run directory: resolved config, metrics.jsonl, default checkpoint and TensorBoard dirs.",
    )
    num_workers: NonNegativeInt = Field(0, description="DataLoader worker processes per rank.")
    data_on_device: Literal["auto"] | bool = Field(
        "auto",
        description="PyTorch on a GPU, data given as tensors or arrays (a TensorDataset): keep it on the device and gather each batch there (true), keep it in host memory and copy each batch ahead of its step (false), or place it when it takes at most a quarter of the free device memory and num_workers is 0 (auto). The choice is logged.",
    )
    drop_last: bool = Field(False, description="Drop each rank's last partial training batch.")
    class_weight: dict[int, float] | None = Field(
        None,
        description="Keras modules and compiled models: each training sample's loss weighted by its class's weight (model.fit's class_weight; classes not named weigh 1).",
    )
    limit_train_batches: PositiveInt | None = Field(
        None, description="Use at most this many training batches per epoch (for quick runs)."
    )
    limit_val_batches: NonNegativeInt | None = Field(
        None,
        description="Use at most this many validation batches (0 turns validation off); model.fit's validation_steps (an endless Keras validation pipeline needs it).",
    )
    validate_every_n_epochs: PositiveInt = Field(1, description="Run validation after every N-th epoch (and the last).")
    val_check_interval: PositiveInt | Annotated[float, Field(gt=0, le=1)] | None = Field(
        None,
        description="Also validate inside the epochs that validate (Lightning's): every N training batches (an int, a multiple of accumulate_grad_batches), or every such fraction of an epoch (a float in (0, 1]); the epoch's end (and the fit's) still validates.",
    )
    progress_bar: bool = Field(True, description="Show a progress bar on rank 0 (only when attached to a terminal).")
    export_dir: str | None = Field(
        None,
        description="Where rank 0 writes the final model at the end of training (model.pt for PyTorch); SageMaker's SM_MODEL_DIR by default there.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for every URL (e.g. {endpoint_url: ..., profile: ...}); secrets are never saved or printed. Default: the standard AWS environment and config files.",
    )
    collective_timeout_s: PositiveFloat = Field(
        300.0,
        description="A barrier that waits longer fails every rank instead of hanging (other collectives after twice this, so the barrier, which names the missing ranks, reports first).",
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="See CheckpointConfig.")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="See TensorBoardConfig.")
    early_stopping: EarlyStoppingConfig | None = Field(None, description="See EarlyStoppingConfig; null turns it off.")
    nan_guard: NanGuardConfig = Field(default_factory=NanGuardConfig, description="See NanGuardConfig.")
    lr_find: LRFindConfig | None = Field(
        None,
        description="See LRFindConfig: a learning-rate range test before the first epoch of a fresh fit (PyTorch modules), e.g. {num_training_steps: 100}.",
    )
    batch_size_find: BatchSizeFindConfig | None = Field(
        None,
        description="See BatchSizeFindConfig: the largest batch size that fits in memory, found by trial steps before the first epoch of a fresh fit (PyTorch modules, one process), e.g. {mode: binsearch}.",
    )
    device_stats: DeviceStatsConfig = Field(
        default_factory=DeviceStatsConfig,
        description="See DeviceStatsConfig: every tensorboard.log_every_n_steps steps, as DeviceStatsMonitor.on_train_batch_start/<key> and .../on_train_batch_end/<key>.",
    )
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig, description="See PreemptionConfig.")
    resume: str | None = Field(
        None,
        description="Resume when no --ckpt-path is given: auto (the last committed checkpoint if there is one, else start fresh; for restarts and spot jobs), last, best, or a checkpoint name or directory.",
    )
    callbacks: list[ClassPath] = Field(
        default_factory=list,
        description="Extra callbacks by class path: subclasses of unifit.Callback, or Lightning callbacks (run as they are or mapped onto unifit's own: docs/lightning.md#callbacks).",
    )

    loggers: list[LoggerSpec] | None = Field(
        None,
        description="Where metrics go, each a name or a name with options: tensorboard, csv, mlflow, wandb, or {class_path: pkg.module:MyLogger, init_args: {...}} (a unifit.loggers.Logger or a Lightning logger); e.g. [tensorboard, {name: mlflow, tracking_uri: 'http://127.0.0.1:5000'}]. Default: [tensorboard] (none when tensorboard.enabled is false). Rank 0 logs; step values every tensorboard.log_every_n_steps.",
    )

    _batch_size_from: str | None = PrivateAttr(None)

    @property
    def batch_size_given(self) -> bool:
        """Whether the user set batch_size (else a DataLoader of their own may bring its batch size)."""
        return "batch_size" in self.model_fields_set and self._batch_size_from is None

    @property
    def batch_size_from(self) -> str | None:
        """Where an adopted batch_size came from (None: the user set it, or the default)."""
        return self._batch_size_from

    def adopting_batch_size(self, batch_size: int, source: str) -> TrainerConfig:
        """This config for one fit, with the batch size of the user's own data (`source`)."""
        adopted = self.model_copy(update={"batch_size": batch_size})
        adopted._batch_size_from = source
        return adopted

    @field_validator("precision", mode="before")
    @classmethod
    def _lightning_precision(cls, value: Any) -> Any:
        """Lightning's 32, 16 and bf16 as unifit's names; its pure half and float64 modes refused in one line."""
        text = str(value)
        if text in PRECISION_SPELLINGS:
            return PRECISION_SPELLINGS[text]
        if text in ("16-true", "bf16-true", "64", "64-true", "transformer-engine", "transformer-engine-float16"):
            raise ValueError(
                f"Lightning's {text} is not run by unifit; use 32-true, bf16-mixed (bfloat16 compute, float32 weights) "
                "or 16-mixed (float16 with loss scaling)"
            )
        return value

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_step(cls, value: Any) -> Any:
        """`compile: step` for true."""
        return True if value == "step" else value

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_mode(cls, value: Any) -> Any:
        """`activation_checkpointing: full` for {mode: full}."""
        return {"mode": value} if isinstance(value, str) else value

    @field_validator("max_time", mode="before")
    @classmethod
    def _seconds(cls, value: Any) -> Any:
        """Lightning's 'DD:HH:MM:SS' as seconds (a number stays a number)."""
        if not isinstance(value, str) or ":" not in value:
            return value
        parts = value.split(":")
        if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"received {value!r}; give seconds (e.g. 3600) or 'DD:HH:MM:SS' (e.g. '00:12:00:00')")
        days, hours, minutes, seconds = (int(p) for p in parts)
        return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)

    def accumulation_at(self, epoch: int) -> int:
        """Micro-batches per optimizer step in `epoch` (from 0)."""
        if not self.accumulation_schedule:
            return self.accumulate_grad_batches
        started = [e for e in self.accumulation_schedule if e <= epoch]
        return self.accumulation_schedule[max(started)] if started else 1

    def accumulations(self) -> set[int]:
        """Every accumulation the fit uses."""
        return {self.accumulation_at(0), *(self.accumulation_schedule or {}).values()}

    @field_validator("accumulation_schedule")
    @classmethod
    def _one_accumulation(cls, schedule: dict[int, int] | None, info: ValidationInfo) -> dict[int, int] | None:
        given = info.data.get("accumulate_grad_batches", 1)
        if schedule and given != 1:
            raise ValueError(f"accumulate_grad_batches={given} is set too; set only one (as Lightning refuses both)")
        return schedule

    @model_validator(mode="after")
    def _one_warmup(self) -> TrainerConfig:
        if self.warmup_steps is not None and self.warmup_epochs > 0:
            raise ValueError(
                f"warmup_epochs={self.warmup_epochs} and warmup_steps={self.warmup_steps} are both set; set only one"
            )
        return self

    @field_validator("loggers", mode="before")
    @classmethod
    def _logger_names(cls, value: Any) -> Any:
        """'csv' is {name: csv}; an unknown name is one line naming the ones there are."""
        if not isinstance(value, list):
            return value
        items = []
        for i, item in enumerate(value):
            kind = _logger_kind(item)
            if kind not in LOGGER_MODELS:
                from unifit.storage import redact

                raise ValueError(
                    f"item {i}: received {redact(item)!r}; a logger is one of {', '.join(list(LOGGER_MODELS)[:-1])}, "
                    "a name with options ({name: mlflow, tracking_uri: ...}) or {class_path: pkg.module:MyLogger}"
                )
            items.append({"name": item} if isinstance(item, str) else item)
        return items

    @model_validator(mode="after")
    def _tensorboard_named_and_off(self) -> TrainerConfig:
        if not self.tensorboard.enabled and any(_logger_kind(item) == "tensorboard" for item in self.loggers or ()):
            raise ValueError("loggers names tensorboard and tensorboard.enabled is false; keep one of the two")
        return self

    @property
    def logger_specs(self) -> list[Any]:
        """The loggers this run writes to: `loggers`, or TensorBoard alone by default."""
        if self.loggers is not None:
            return list(self.loggers)
        return [TensorBoardLoggerConfig(name="tensorboard")] if self.tensorboard.enabled else []

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or join_path(self.root_dir, "checkpoints")

    @property
    def tensorboard_dir(self) -> str | None:
        """Always local (event files are written locally and synced); None: a temporary directory."""
        if self.tensorboard.log_dir:  # a URL: event files are appended to as training runs, so they are synced there
            return None if "://" in self.tensorboard.log_dir else self.tensorboard.log_dir
        return None if "://" in self.root_dir else join_path(self.root_dir, "tensorboard")

    @property
    def tensorboard_sync_to(self) -> str | None:
        """Where event files are mirrored: `sync_to`, a URL log_dir, or <root_dir>/tensorboard for a URL root_dir."""
        log_dir = self.tensorboard.log_dir
        if self.tensorboard.sync_to or (log_dir and "://" not in log_dir):
            return self.tensorboard.sync_to
        if log_dir:  # a URL
            return log_dir
        return None if "://" not in self.root_dir else join_path(self.root_dir, "tensorboard")


class ExperimentConfig(_Strict):
    """One experiment file: the module, optional data provider, and trainer options."""

    module: ClassPath = Field(description="The TrainModule (or KerasModule) subclass and its init args.")
    data: ClassPath | None = Field(
        None,
        description="Optional data provider with train_dataset()/val_dataset(); default: the module's own methods.",
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="See TrainerConfig.")

    _lightning_run: Any = PrivateAttr(None)  # set when the file was a LightningCLI config (config/lightning_cli.py)


def join_path(base: str, *parts: str) -> str:
    """Join a local path or URL with '/' (fsspec paths use '/', also for s3://)."""
    return "/".join([base.rstrip("/"), *parts])
