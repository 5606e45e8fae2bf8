"""A small GPT-style language model for the model-parallel tests, as a unifit TrainModule (split by a plan in the
YAML); tests/probe/tiny_gpt_lightning.py has the same network as LightningModules. Same weights from the same seed;
attention reshapes heads with -1, so a rank's part of the heads works as well as all of them.

Neither Lightning nor torchmetrics is imported here unless asked for (`torchmetrics_val: true`): each costs seconds
of start-up in every rank of every launch, and most runs check other things."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import unifit

PLAN = {
    "net.embed": "rowwise",
    "net.blocks.*.attn.q": "colwise",
    "net.blocks.*.attn.k": "colwise",
    "net.blocks.*.attn.v": "colwise",
    "net.blocks.*.attn.o": "rowwise",
    "net.blocks.*.mlp.up": "colwise",
    "net.blocks.*.mlp.down": "rowwise",
    "net.head": "colwise_gather",
}
# PLAN with sequence parallelism: the residual stream cut along the sequence from each block's input to the head
SEQUENCE_PLAN = {
    **PLAN,
    "net.blocks.*": "sequence",
    "net.blocks.*.norm1": "sequence",
    "net.blocks.*.norm2": "sequence",
    "net.blocks.*.attn.o": "rowwise_sequence",
    "net.blocks.*.mlp.down": "rowwise_sequence",
    "net.norm": "sequence",
}
# transformers' Llama (TransformersLlama) written by hand with sequence parallelism: its `_tp_plan` plus the decoder
# layers, their norms and the final norm on sequence shards (the rotary table stays whole: q and k are gathered)
LLAMA_SEQUENCE_PLAN = {
    "model.model.embed_tokens": "rowwise",
    "model.model.layers.*": "sequence",
    "model.model.layers.*.input_layernorm": "sequence",
    "model.model.layers.*.post_attention_layernorm": "sequence",
    **{f"model.model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
    "model.model.layers.*.self_attn.o_proj": "rowwise_sequence",
    "model.model.layers.*.mlp.gate_proj": "colwise",
    "model.model.layers.*.mlp.up_proj": "colwise",
    "model.model.layers.*.mlp.down_proj": "rowwise_sequence",
    "model.model.norm": "sequence",
    "model.lm_head": "colwise_gather",
}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = (
            nn.LayerNorm(dim),
            Attention(dim, heads),
            nn.LayerNorm(dim),
            MLP(dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, dim: int, heads: int, layers: int, seq: int, tied: bool = False, skip: bool = False
    ) -> None:
        super().__init__()
        self.skip = skip  # the first block's output added again after the last: a skip across every split point
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        if tied:  # GPT-2's: the head reads the embedding's weight (under pipelining: the first and last stage)
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        return self.head(self.norm(x + outputs[0] if self.skip else x))


class GPTWithLoss(GPT):
    """nanoGPT's convention (and transformers' with `labels`): the targets go into the network, which returns the
    logits and the loss, so the loss is computed inside the last pipeline stage and the targets must reach it."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(tokens)
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tokens(n: int, seq: int, vocab: int, seed: int) -> TensorDataset:
    """Sequences with structure to learn: each token is the previous plus a per-sequence stride."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return TensorDataset((start + stride * torch.arange(seq + 1)) % vocab)


def lm_loss(net: nn.Module, batch) -> torch.Tensor:
    (seqs,) = batch
    logits = net(seqs[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1))


def cut_to_its_own_length(rows: list[tuple[torch.Tensor]]) -> tuple[torch.Tensor]:
    """A collate cutting each batch to a length of its own, as padding to a batch's longest sequence does: 15 to 17
    tokens by the batch's content, so replicas meet different shapes at the same step."""
    seqs = torch.stack([row[0] for row in rows])
    return (seqs[:, : 15 + int(seqs[0, 0]) % 3],)


class TinyGPT(unifit.TrainModule):
    def __init__(
        self,
        vocab=64,
        dim=32,
        heads=4,
        layers=2,
        seq=16,
        n_train=64,
        n_val=32,
        lr=3e-3,
        tied=False,
        skip=False,
        ragged=False,
        torchmetrics_val=False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = GPT(vocab, dim, heads, layers, seq, tied, skip)
        self.vocab, self.seq, self.n_train, self.n_val, self.lr = vocab, seq, n_train, n_val, lr
        self.ragged = ragged  # training batches of their own lengths (cut_to_its_own_length)
        self.val_samples = None
        if torchmetrics_val:  # val_samples counted by a torchmetrics metric: its states gathered once per replica
            import torchmetrics

            self.val_samples = torchmetrics.SumMetric()

    def training_step(self, batch, batch_idx):
        self.log("samples_seen", float(len(batch[0])), reduce_fx="sum")  # each sample once, whatever the layout
        return lm_loss(self.net, batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", lm_loss(self.net, batch))
        if self.val_samples is None:
            self.log("val_samples", float(len(batch[0])), reduce_fx="sum")
        else:  # a torchmetrics sum: each sample once, not per tensor rank
            self.val_samples.update(torch.ones(len(batch[0])))
            self.log("val_samples", self.val_samples)

    def predict_step(self, batch, batch_idx):
        """Each sequence's predicted next token after its last one."""
        (seqs,) = batch
        return self.net(seqs[:, :-1])[:, -1].argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    def predict_dataset(self):
        return tokens(self.n_val, self.seq, self.vocab, seed=3)

    def train_dataset(self):
        data = tokens(self.n_train, self.seq, self.vocab, seed=1)
        if self.ragged:  # the user's DataLoader: unifit keeps its collate and shards its sampling
            return torch.utils.data.DataLoader(data, batch_size=8, collate_fn=cut_to_its_own_length)
        return data

    def val_dataset(self):
        return tokens(self.n_val, self.seq, self.vocab, seed=2)


class TargetsGPT(TinyGPT):
    """TinyGPT with its loss inside the network (GPTWithLoss): the same weights from the same seed."""

    def __init__(self, tied=False) -> None:
        super().__init__(tied=tied)
        torch.manual_seed(0)
        self.net = GPTWithLoss(self.vocab, 32, 4, 2, self.seq, tied)

    def training_step(self, batch, batch_idx):
        (seqs,) = batch
        self.log("samples_seen", float(len(seqs)), reduce_fx="sum")
        _, loss = self.net(seqs[:, :-1], seqs[:, 1:])
        return loss

    def validation_step(self, batch, batch_idx):
        (seqs,) = batch
        self.log("val_loss", self.net(seqs[:, :-1], seqs[:, 1:])[1])


class SavedBeforeTheFirstBatch(unifit.Callback):
    """A checkpoint named `start` before any batch (as a callback or a preemption during the first batch may take):
    under pipeline stages it is written before the first batch has built them."""

    def on_train_epoch_start(self, ctx):
        if ctx.progress.optimizer_step == 0 and ctx.progress.epoch == 0:
            ctx.save_checkpoint("start")


class NormInputShapes(unifit.Callback):
    """Writes the shape of the tokens the first block's first norm computes on, on this rank (DTensors: their local
    part), to `<root_dir>/norm_input_rank<r>.json`: under sequence parallelism, 1/T of the sequence."""

    def on_fit_start(self, ctx):
        self.shapes = []
        norm = ctx.module.net.blocks[0].norm1
        local = lambda x: x.to_local() if hasattr(x, "to_local") else x  # noqa: E731
        self.hook = norm.register_forward_pre_hook(lambda _, args: self.shapes.append(list(local(args[0]).shape)))

    def on_fit_end(self, ctx):
        import json
        from pathlib import Path

        self.hook.remove()
        Path(ctx.config.root_dir, f"norm_input_rank{ctx.rank}.json").write_text(json.dumps(self.shapes[:1]))
