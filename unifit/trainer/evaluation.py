"""validate / test / predict: one pass over a stage's data, sharded over every rank, no training.

set up the strategy, and the engine for the stage (the model only: no optimizer, no training data)
load the weights of --ckpt-path (best | last | a name | a directory), if given
for batch in this rank's disjoint shard (uneven shards, no padding: nothing is counted twice):
    validate/test: the module's validation_step / test_step logs metrics
    predict: predict_step's outputs are kept, sample by sample, with their dataset index
metrics: exact sample-weighted means over every rank (and what the end-of-stage hooks log, reduced after them)
predictions: gathered on rank 0 in dataset order, each sample exactly once (other ranks get None)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import yaml

from unifit.checkpoint.checkpointer import Checkpointer
from unifit.config.schema import TrainerConfig
from unifit.errors import ConfigError
from unifit.loggers import LoggerConnector, RunInfo
from unifit.loggers.base import flatten
from unifit.trainer.adapt import prepare, set_up

log = logging.getLogger("unifit")

STAGES = ("validate", "test", "predict")


@dataclass
class Evaluation:
    """What validate/test/predict return: metrics on every rank, predictions on rank 0."""

    stage: str
    metrics: dict[str, float] = field(default_factory=dict)
    predictions: Any = None
    checkpoint: str | None = None  # the checkpoint whose weights were evaluated


def evaluate(
    config: TrainerConfig,
    stage: str,
    module: Any,
    data: Any = None,
    ckpt_path: str | None = None,
    *,
    callbacks: list[Any] | None = None,
    keep_predictions: bool = True,
    loggers: list[Any] | None = None,
    resolved_config: str = "{}",
    step: int = 0,
) -> Evaluation:
    """`callbacks`: the Trainer's Lightning callbacks (their hooks of this stage run around the module's);
    `keep_predictions=False`: predictions are not gathered to rank 0 (a prediction writer saves each rank's);
    `loggers`: validate/test metrics go to them (rank 0), in the tracked run of the checkpoint evaluated, at its
    step (without a checkpoint: at `step`, the last fit's)."""
    if stage not in STAGES:
        raise ConfigError(f"stage: received {stage!r}; use one of {', '.join(STAGES)}")
    prepared = prepare(config, module, data, callbacks)
    config = prepared.plan.config
    module, strategy, engine = set_up(config, prepared.module, prepared.data)
    result = Evaluation(stage)
    logging_to = LoggerConnector(loggers or [], config.tensorboard.log_every_n_steps)
    status = "failed"
    try:
        strategy.setup()
        strategy.rank_zero_call(lambda: [logger.check() for logger in logging_to.loggers])  # unreachable: now
        module.use_loggers(logging_to.loggers)
        engine.seed(config.seed)
        engine.setup_evaluation(stage)
        if ckpt_path:
            checkpoints = Checkpointer(engine, strategy, config)
            snapshot, result.checkpoint = checkpoints.read(ckpt_path)
            if snapshot is None:
                raise ConfigError(
                    f"--ckpt-path {ckpt_path}: no committed checkpoint in {checkpoints.store.url} to {stage}; train "
                    "first, or name a checkpoint directory"
                )
            engine.load_weights(snapshot.engine)
            module.evaluation_weights(snapshot.callbacks)
            if strategy.is_global_zero:
                log.info("%s: weights of %s", stage, result.checkpoint)
        step = snapshot.trainer.global_step if ckpt_path else step
        if strategy.is_global_zero and logging_to.loggers:  # open before the first batch: self.logger writes
            states = snapshot.callbacks.get("Loggers") if ckpt_path else None
            logging_to.start_evaluation(_run_info(config, resolved_config), states)
        engine.collector.reset()
        module.enter_evaluation(stage)
        module.on_evaluation_start(stage)
        kept: dict[int, list[Any]] = {}  # loader -> its samples' outputs, in this rank's order
        for batch_idx, batch in enumerate(engine.eval_batches()):
            outputs = engine.eval_step(batch, batch_idx)
            if stage == "predict" and keep_predictions:
                kept.setdefault(engine.eval_loader, []).extend(engine.unbatch(outputs))
        if stage == "predict" and keep_predictions:
            ordered = [_in_dataset_order(strategy, engine, kept.get(i, []), i) for i in range(engine.eval_loader_count)]
            result.predictions = ordered[0] if len(ordered) == 1 else ordered  # several loaders: a list, as Lightning
        else:
            result.metrics = engine.collector.reduce(strategy)
        module.on_evaluation_end(stage)
        if stage != "predict":  # what on_<stage>_epoch_end logged (a LightningModule's), reduced over the ranks
            result.metrics.update(engine.collector.reduce(strategy))
        module.exit_evaluation(stage)  # the modes from before (a LightningModule: on_<stage>_model_train), teardown
        if strategy.is_global_zero:
            logging_to.log_evaluation(result.metrics, step)
        status = "success"
        return result
    finally:
        try:
            if strategy.is_global_zero:
                logging_to.finish(status)
        finally:
            engine.close()
            strategy.teardown()


def _run_info(config: TrainerConfig, resolved_config: str) -> RunInfo:
    """An evaluation adds to what the run directory and the tracked run hold (drops nothing from metrics.csv)."""
    return RunInfo(
        root_dir=config.root_dir,
        hyperparameters=flatten(yaml.safe_load(resolved_config) or {}),
        resumed_at_step=None,
        storage_options=config.storage_options,
        adds_to_run=True,
    )


def _in_dataset_order(strategy: Any, engine: Any, samples: list[Any], loader: int = 0) -> Any:
    """Every rank's (index, sample) pairs of one loader on rank 0, sorted by dataset index and collated."""
    indices = list(engine.eval_indices(loader))
    if len(indices) != len(samples):
        raise ConfigError(
            f"predict_step returned {len(samples)} samples for the {len(indices)} this rank predicted; "
            "return one output row per input sample"
        )
    gathered = strategy.all_gather_object(list(zip(indices, samples)))
    if not strategy.is_global_zero:
        return None
    reported = (pairs for rank, pairs in enumerate(gathered) if strategy.reports_metrics(rank))  # each replica's once
    ordered = sorted((pair for rank_pairs in reported for pair in rank_pairs), key=lambda pair: pair[0])
    return engine.collate([sample for _, sample in ordered])
