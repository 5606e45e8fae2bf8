"""Third-party PyTorch models, used unchanged, in tiny configurations on synthetic data (no downloads).

Each entry builds (LightningModule, LightningDataModule) the way their users write them:
- Lightning's own demos: BoringModel (+ BoringDataModule), LightningTransformer, LightningLSTM (its
  SequenceSampler batch sampler); subclassed only to skip WikiText2's download (and, for the LSTM, to
  build the demo's SimpleLSTM small);
- Hugging Face transformers models in LightningModules written as the HF/Lightning tutorials write them:
  GPT-2 (tied embeddings, AdamW + get_linear_schedule_with_warmup stepped per step), a BERT sequence
  classifier, and a ResNet-18 (BatchNorm) on 32x32 images with SGD + OneCycleLR sized by
  trainer.estimated_stepping_batches, as Lightning's CIFAR-10 tutorial does;
- LightningModules that take part in their own step (tests/zoo/own_step_models.py), and Lightning's own
  ManualOptimBoringModel: manual optimization and the hooks inside the optimizer step;
- on a GPU machine also torchvision's resnet18(num_classes=10) in that tutorial's module (CPU builds of
  torchvision are not on PyPI, and PyPI's CUDA build does not load beside the CPU torch pinned here).

Dropout is set to 0 (a configuration, not a code change) so that runs on different numbers of ranks,
whose random streams differ, can be compared step by step.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel, ManualOptimBoringModel
from lightning.pytorch.demos.lstm import LightningLSTM, SequenceSampler, SimpleLSTM
from lightning.pytorch.demos.transformer import LightningTransformer
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.zoo import callback_models, logging_models, own_step_models

VOCAB = 64
SEQ = 12


class RandomTokens(Dataset):
    """WikiText2's items (input block, the block shifted by one), over random tokens."""

    def __init__(self, n: int, block: int = SEQ, vocab: int = VOCAB, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n * block + 1,), generator=g)
        self.block = block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.block
        return self.data[s : s + self.block], self.data[s + 1 : s + 1 + self.block]


class TokensData(L.LightningDataModule):
    def __init__(self, batch_size: int, n_train: int = 64, n_val: int = 24) -> None:
        super().__init__()
        self.batch_size, self.train, self.val = batch_size, RandomTokens(n_train), RandomTokens(n_val, seed=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)


# ---- Lightning's demos --------------------------------------------------------------------------------
class DemoTransformer(LightningTransformer):
    def prepare_data(self) -> None:  # the demo downloads WikiText2 here
        pass


class DemoLSTM(LightningLSTM):
    def __init__(self, vocab_size: int = VOCAB) -> None:
        super().__init__(vocab_size=vocab_size)
        self.model = SimpleLSTM(vocab_size=vocab_size, ninp=32, nhid=32, nlayers=2)  # the demo's model, small

    def prepare_data(self) -> None:
        pass

    # the hidden state carried from batch to batch is no weight: as in Lightning, a checkpoint holds it only
    # when the module puts it there (without, a mid-epoch resume restarts the sequence from zeros)
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["hidden"] = None if self.hidden is None else tuple(h.detach() for h in self.hidden)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.hidden = checkpoint.get("hidden")

    def train_dataloader(self) -> DataLoader:  # the demo's own loader and batch sampler, over random tokens
        dataset = RandomTokens(80)
        return DataLoader(dataset, batch_sampler=SequenceSampler(dataset, batch_size=8))


# ---- Hugging Face models, as their tutorials put them in a LightningModule ---------------------------
class GPT2LM(L.LightningModule):
    def __init__(self, lr: float = 3e-3, warmup_steps: int = 4) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.save_hyperparameters()
        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.model = GPT2LMHeadModel(config)  # lm_head.weight is tied to transformer.wte.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        return self.model(input_ids=input_ids, labels=labels)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, _ = batch
        loss = self(inputs, labels=inputs).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, _ = batch
        self.log("val_loss", self(inputs, labels=inputs).loss, prog_bar=True)

    def configure_optimizers(self) -> Any:
        from transformers import get_linear_schedule_with_warmup

        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        scheduler = get_linear_schedule_with_warmup(
            optimizer,
            num_warmup_steps=self.hparams.warmup_steps,
            num_training_steps=self.trainer.estimated_stepping_batches,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


class Sentences(Dataset):
    """Random token sequences labelled by whether token 7 occurs in them (a learnable classification)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.labels = (self.ids == 7).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.labels[i]}


class SentencesData(L.LightningDataModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size, self.train, self.val = batch_size, Sentences(64), Sentences(24, seed=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)


class BertClassifier(L.LightningModule):
    """Lightning's text-transformers tutorial shape: the model's own loss, accuracy logged in validation."""

    def __init__(self, lr: float = 2e-3) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        self.save_hyperparameters()
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            num_labels=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.model = BertForSequenceClassification(config)

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(**batch).loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        outputs = self(**batch)
        self.log("val_loss", outputs.loss)
        self.log("val_acc", (outputs.logits.argmax(-1) == batch["labels"]).float().mean())

    def configure_optimizers(self) -> Any:
        from transformers import get_linear_schedule_with_warmup

        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = get_linear_schedule_with_warmup(optimizer, 0, self.trainer.estimated_stepping_batches)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


class Images(L.LightningDataModule):
    """32x32 RGB images whose class is the brightest of 10 fixed patterns they were mixed with."""

    def __init__(self, batch_size: int, n_train: int = 64, n_val: int = 24) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        patterns = torch.randn(10, 3, 32, 32, generator=g)
        self.batch_size = batch_size

        def draw(n: int) -> TensorDataset:
            y = torch.randint(0, 10, (n,), generator=g)
            return TensorDataset(0.5 * torch.randn(n, 3, 32, 32, generator=g) + patterns[y], y)

        self.train, self.val = draw(n_train), draw(n_val)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)


class ImageClassifier(L.LightningModule):
    """Lightning's CIFAR-10 tutorial (LitResnet): SGD with momentum, OneCycleLR per step, accuracy logged."""

    def __init__(self, net: str = "hf-resnet18", lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = _resnet(net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        return F.log_softmax(getattr(out, "logits", out), dim=1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.nll_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.nll_loss(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=5e-4)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, 0.1, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _resnet(net: str) -> torch.nn.Module:
    if net == "torchvision-resnet18":  # the tutorial's own: torchvision's, its stem made for 32x32 inputs
        import torchvision

        model = torchvision.models.resnet18(weights=None, num_classes=10)
        model.conv1 = torch.nn.Conv2d(3, 64, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=False)
        model.maxpool = torch.nn.Identity()
        return model
    from transformers import ResNetConfig, ResNetForImageClassification  # ResNet-18's layout (basic blocks, 2-2-2-2)

    return ResNetForImageClassification(
        ResNetConfig(
            num_channels=3,
            embedding_size=16,
            hidden_sizes=[16, 32, 64, 64],
            depths=[2, 2, 2, 2],
            layer_type="basic",
            num_labels=10,
            downsample_in_first_stage=False,
        )
    )


def _without_dropout(module: torch.nn.Module) -> torch.nn.Module:
    """Every dropout probability to 0 (nn.Dropout, nn.LSTM's and MultiheadAttention's own): a config change."""
    for m in module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        elif isinstance(m, (torch.nn.LSTM, torch.nn.MultiheadAttention)):
            m.dropout = 0.0
    return module


# name -> (build(per_rank_batch) -> (LightningModule, LightningDataModule | None), has BatchNorm)
MODELS: dict[str, tuple[Callable[[int], tuple[Any, Any]], bool]] = {
    "boring": (lambda b: (BoringModel(), BoringDataModule()), False),
    "transformer": (lambda b: (_without_dropout(DemoTransformer(vocab_size=VOCAB)), TokensData(b)), False),
    "lstm": (lambda b: (_without_dropout(DemoLSTM()), None), False),
    "gpt2": (lambda b: (GPT2LM(), TokensData(b)), False),
    "bert": (lambda b: (BertClassifier(), SentencesData(b)), False),
    "resnet": (lambda b: (ImageClassifier(), Images(b)), True),
    "manual-boring": (lambda b: (ManualOptimBoringModel(), BoringDataModule()), False),
    **own_step_models.MODELS,
    **logging_models.MODELS,
    **callback_models.MODELS,
}
MANUAL = {"manual-boring", *own_step_models.MANUAL}  # accumulate_grad_batches is refused with manual optimization
SAMPLED = own_step_models.SAMPLED  # a user's sampler draws: not step-comparable with Lightning or across world sizes
GPU_MODELS = {**MODELS, "torchvision-resnet": (lambda b: (ImageClassifier("torchvision-resnet18"), Images(b)), True)}
