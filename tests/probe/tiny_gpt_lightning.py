"""tests/probe/tiny_gpt.py's network as LightningModules: one written for Lightning's ModelParallelStrategy (its
configure_model splits the layers over self.device_mesh["tensor_parallel"] and shards with fully_shard over
"data_parallel", as Lightning's tensor-parallel example does), the same unsplit, and transformers' Llama in a
tutorial-style LightningModule. A file of their own: importing Lightning costs every rank seconds."""

from __future__ import annotations

import lightning as L
import torch

from tests.probe.tiny_gpt import GPT, lm_loss, tokens


class TokensLightning(L.LightningModule):
    """What the LightningModules below share: AdamW, and the tokens as DataLoaders of 8."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(tokens(self.n_train, self.seq, self.vocab, seed=1), batch_size=8)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(tokens(self.n_val, self.seq, self.vocab, seed=2), batch_size=8)


class LightningTP(TokensLightning):
    """Written for Lightning's ModelParallelStrategy: nothing unifit-specific."""

    def __init__(self, vocab=64, dim=32, heads=4, layers=2, seq=16, n_train=64, n_val=32, lr=3e-3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = GPT(vocab, dim, heads, layers, seq)
        self.vocab, self.seq, self.n_train, self.n_val, self.lr = vocab, seq, n_train, n_val, lr

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        parallelize_module(
            self.net,
            tp_mesh,
            {
                "embed": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Replicate()),
            },
        )
        for block in self.net.blocks:
            parallelize_module(
                block,
                tp_mesh,
                {
                    "attn.q": ColwiseParallel(),
                    "attn.k": ColwiseParallel(),
                    "attn.v": ColwiseParallel(),
                    "attn.o": RowwiseParallel(),
                    "mlp.up": ColwiseParallel(),
                    "mlp.down": RowwiseParallel(),
                },
            )
        if dp_mesh.size() > 1:
            for block in self.net.blocks:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(self.net, mesh=dp_mesh)

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.net, batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", lm_loss(self.net, batch))


class LightningWhole(LightningTP):
    """The same module unsplit (its configure_model does nothing): the reference ddp and one process train."""

    def configure_model(self):
        pass


class TransformersLlama(TokensLightning):
    """A Hugging Face transformers Llama (its code unchanged, a tiny configuration, embeddings tied to the head) in a
    LightningModule as the HF/Lightning tutorials write one; `plan: auto` splits it by the model's own `_tp_plan`."""

    def __init__(self, vocab=64, dim=32, heads=4, kv_heads=4, layers=2, seq=16, n_train=64, n_val=32, lr=3e-3):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=dim,
            intermediate_size=2 * dim,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=seq + 1,
            tie_word_embeddings=True,
        )
        self.model = LlamaForCausalLM(config)
        self.vocab, self.seq, self.n_train, self.n_val, self.lr = vocab, seq, n_train, n_val, lr

    def training_step(self, batch, batch_idx):
        (seqs,) = batch
        self.log("samples_seen", float(len(seqs)), reduce_fx="sum")
        loss = self.model(input_ids=seqs, labels=seqs).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (seqs,) = batch
        self.log("val_loss", self.model(input_ids=seqs, labels=seqs).loss)
