"""LightningModules that log where Lightning's examples log, not only in the steps.

`GLUETransformer` is the module of Lightning's "Finetune Transformers Models with PyTorch Lightning" tutorial
(GLUE), written as the tutorial writes it: validation_step collects every batch's loss, predictions and labels
per dataloader, and on_validation_epoch_end computes the metrics over them and logs them. Two things are made
small or local, not rewritten: the Hugging Face model is a tiny BERT built from a config (no download), and
the GLUE metric (`evaluate.load("glue", ...)`, a download) is its accuracy, computed the same way on numpy.

The zoo runs it as the tutorial runs MNLI: two validation loaders (matched, mismatched), each step told its
`dataloader_idx`. `LoggingEverywhere` adds what Lightning's docs show around it: reduce_fx max / min / sum in the step, logging in
the batch hooks, in on_train_epoch_start / on_train_epoch_end, and a rank_zero_only value.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning as L
import numpy as np
import torch


class GlueAccuracy:
    """What evaluate.load("glue", "mrpc"/"sst2"...).compute returns for accuracy, on numpy."""

    def compute(self, predictions: np.ndarray, references: np.ndarray) -> dict[str, float]:
        return {"accuracy": float((predictions == references).mean())}


class GLUETransformer(L.LightningModule):
    def __init__(
        self,
        num_labels: int = 2,
        task_name: str = "sst2",
        learning_rate: float = 2e-3,
        adam_epsilon: float = 1e-8,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        eval_splits: list[str] | None = None,
        vocab_size: int = 64,
    ) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        self.save_hyperparameters()
        config = BertConfig(  # the tutorial: AutoConfig.from_pretrained(model_name_or_path, num_labels=num_labels)
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            num_labels=num_labels,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.model = BertForSequenceClassification(config)
        self.metric = GlueAccuracy()
        self.outputs: dict[int, list[dict[str, torch.Tensor]]] = defaultdict(list)

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        outputs = self(**batch)
        loss = outputs[0]
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        outputs = self(**batch)
        val_loss, logits = outputs[:2]

        if self.hparams.num_labels > 1:
            preds = torch.argmax(logits, axis=1)
        elif self.hparams.num_labels == 1:
            preds = logits.squeeze()

        labels = batch["labels"]

        self.outputs[dataloader_idx].append({"loss": val_loss, "preds": preds, "labels": labels})

    def on_validation_epoch_end(self) -> Any:
        if self.hparams.task_name == "mnli":
            for i, outputs in self.outputs.items():
                # matched or mismatched
                split = self.hparams.eval_splits[i].split("_")[-1]
                preds = torch.cat([x["preds"] for x in outputs]).detach().cpu().numpy()
                labels = torch.cat([x["labels"] for x in outputs]).detach().cpu().numpy()
                loss = torch.stack([x["loss"] for x in outputs]).mean()
                self.log(f"val_loss_{split}", loss, prog_bar=True)
                split_metrics = {
                    f"{k}_{split}": v for k, v in self.metric.compute(predictions=preds, references=labels).items()
                }
                self.log_dict(split_metrics, prog_bar=True)
            self.outputs.clear()
            return loss

        flat_outputs = []
        for lst in self.outputs.values():
            flat_outputs.extend(lst)

        preds = torch.cat([x["preds"] for x in flat_outputs]).detach().cpu().numpy()
        labels = torch.cat([x["labels"] for x in flat_outputs]).detach().cpu().numpy()
        loss = torch.stack([x["loss"] for x in flat_outputs]).mean()
        self.log("val_loss", loss, prog_bar=True)
        self.log_dict(self.metric.compute(predictions=preds, references=labels), prog_bar=True)
        self.outputs.clear()

    def configure_optimizers(self) -> Any:
        """Prepare optimizer and schedule (linear warmup and decay)"""
        from transformers import get_linear_schedule_with_warmup

        model = self.model
        no_decay = ["bias", "LayerNorm.weight"]
        optimizer_grouped_parameters = [
            {
                "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
                "weight_decay": self.hparams.weight_decay,
            },
            {
                "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
                "weight_decay": 0.0,
            },
        ]
        optimizer = torch.optim.AdamW(
            optimizer_grouped_parameters, lr=self.hparams.learning_rate, eps=self.hparams.adam_epsilon
        )

        scheduler = get_linear_schedule_with_warmup(
            optimizer,
            num_warmup_steps=self.hparams.warmup_steps,
            num_training_steps=self.trainer.estimated_stepping_batches,
        )
        scheduler = {"scheduler": scheduler, "interval": "step", "frequency": 1}
        return [optimizer], [scheduler]


class LoggingEverywhere(GLUETransformer):
    """The tutorial's module, logging also where Lightning's logging docs show (epoch values: on_epoch=True)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        self.log("train_loss_max", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("train_loss_min", loss, on_step=False, on_epoch=True, reduce_fx=torch.min)
        self.log("samples", float(len(batch["labels"])), on_step=False, on_epoch=True, reduce_fx="sum")
        return loss

    def on_train_epoch_start(self) -> None:
        self.log("epoch_started", float(self.current_epoch))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("label_mean", batch["labels"].float().mean(), on_step=False, on_epoch=True)

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_batches", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")

    def on_train_epoch_end(self) -> None:
        self.log("epoch_ended", float(self.current_epoch) + 0.5)
        if self.trainer.is_global_zero:
            self.log("rank0_only", float(self.global_step), rank_zero_only=True)


def _glue(batch: int) -> tuple[Any, Any]:
    from torch.utils.data import DataLoader

    from tests.zoo.torch_models import VOCAB, Sentences, SentencesData

    class MatchedAndMismatched(SentencesData):  # the tutorial's data module gives MNLI's two splits so
        def val_dataloader(self) -> list[DataLoader]:
            return [DataLoader(self.val, batch_size=self.batch_size), DataLoader(Sentences(16, 2), self.batch_size)]

    module = LoggingEverywhere(vocab_size=VOCAB, task_name="mnli", eval_splits=SPLITS)
    return module, MatchedAndMismatched(batch)


SPLITS = ["validation_matched", "validation_mismatched"]
# name -> (build(per_rank_batch) -> (LightningModule, LightningDataModule), has BatchNorm)


MODELS = {"glue": (_glue, False)}
