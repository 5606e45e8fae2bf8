"""trainer.activation_checkpointing (issue #49, item 1) on a Hugging Face GPT-2 (transformers' code, a tiny
configuration with dropout everywhere), in one process: full and selective train to the weights of none (within
1e-6: dropout draws the same in the recompute), keep fewer bytes for backward (torch's profiler's net allocation of
a training forward of the trained model), wrap every n-th block only when asked, leave the state_dict's keys alone; bad input is
one line; compiled per block, or whole with selective checkpointing, it trains as eager. Under tensor parallel x fsdp and fsdp (against ddp without it, a checkpoint taken with it resumed without
it): tests/test_model_parallel.py's first test."""

from __future__ import annotations

import pytest
import torch

import unifit

VOCAB, SEQ, LAYERS = 64, 16, 4


class GPT2(unifit.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=LAYERS, n_head=4, resid_pdrop=0.1, embd_pdrop=0.1
        )
        config.attn_pdrop = 0.1
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        (seqs,) = batch
        return self.model(input_ids=seqs, labels=seqs).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataset(self):
        generator = torch.Generator().manual_seed(1)
        return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (32, SEQ), generator=generator))


def _fit(tmp_path, checkpointing, name):
    module = GPT2()
    trainer = unifit.Trainer(
        max_epochs=2,
        batch_size=8,
        seed=0,
        progress_bar=False,
        tensorboard={"enabled": False},
        checkpoint={"enabled": False},
        root_dir=str(tmp_path / name),
        activation_checkpointing=checkpointing,
    )
    trainer.fit(module)
    return module


def _kept_bytes(module) -> int:
    """What one training forward leaves allocated for backward, in bytes: torch's profiler's net CPU allocation
    of the forward's ops (a selective checkpoint keeps its ops' outputs outside autograd's saved tensors)."""
    seqs = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(2))
    module.train()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        loss = module.model(input_ids=seqs, labels=seqs).loss
    loss.backward()
    return sum(event.self_cpu_memory_usage for event in profile.key_averages())


def _wrapped(module) -> list[str]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return [name for name, m in module.named_modules() if isinstance(m, CheckpointWrapper)]


@pytest.mark.timeout(240)
def test_full_and_selective_train_as_none_and_keep_less_for_backward(tmp_path, caplog):
    caplog.set_level("INFO", logger="unifit")
    fitted = {mode: _fit(tmp_path, mode, mode) for mode in ("none", "full", "selective")}
    plain = fitted["none"].state_dict()
    for mode in ("full", "selective"):
        module = fitted[mode]
        assert _wrapped(module) == [f"model.transformer.h.{i}" for i in range(LAYERS)], mode
        state = module.state_dict()
        assert list(state) == list(plain), mode  # the wrapper's prefix never reaches a checkpoint
        for key in plain:  # the recompute draws the same dropout; a gradient summed in another order: ~1e-8
            torch.testing.assert_close(state[key], plain[key], atol=1e-6, rtol=0, msg=f"{mode} {key}")
    saved = {mode: _kept_bytes(module) for mode, module in fitted.items()}
    assert saved["full"] < saved["selective"] < saved["none"], saved
    assert saved["full"] < 0.6 * saved["none"], saved
    assert "activation checkpointing: selective, on model.transformer.h.0, model.transformer.h.1" in caplog.text


@pytest.mark.timeout(120)
def test_every_n_blocks_and_named_blocks(tmp_path):
    module = _fit(tmp_path, {"mode": "full", "every_n_blocks": 2, "blocks": ["GPT2Block"]}, "every2")
    assert _wrapped(module) == ["model.transformer.h.1", "model.transformer.h.3"]


@pytest.mark.timeout(120)
def test_bad_input_is_one_line_before_training(tmp_path):
    from unifit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"blocks: LlamaBlock names no submodule of GPT2; its submodule classes"):
        _fit(tmp_path, {"mode": "full", "blocks": ["LlamaBlock"]}, "named")

    class Linear(unifit.TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataset(self):
            return torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16))

    trainer = unifit.Trainer(
        max_epochs=1, progress_bar=False, root_dir=str(tmp_path / "flat"), activation_checkpointing="full"
    )
    with pytest.raises(ConfigError, match=r"activation_checkpointing: Linear has no ModuleList or Sequential"):
        trainer.fit(Linear())
    with pytest.raises(Exception, match=r"activation_checkpointing\.mode"):
        unifit.Trainer(activation_checkpointing="everything")


@pytest.mark.timeout(300)
def test_compiling_per_block_compiles_one_graph_for_identical_blocks_and_trains_as_eager(tmp_path, caplog):
    """trainer.compile: blocks (regional compilation): each GPT-2 block's forward compiled on its own, the 4 blocks
    share one graph; and compile: true with selective checkpointing. Without dropout (compiled code draws other
    masks), both train as eager."""
    caplog.set_level("INFO", logger="unifit")

    def fit(name, **options):
        module = GPT2()
        module.model.config.resid_pdrop = module.model.config.embd_pdrop = module.model.config.attn_pdrop = 0.0
        for layer in module.model.modules():
            if isinstance(layer, torch.nn.Dropout):
                layer.p = 0.0
        unifit.Trainer(
            max_epochs=2,
            batch_size=8,
            limit_train_batches=2,
            seed=0,
            progress_bar=False,
            tensorboard={"enabled": False},
            checkpoint={"enabled": False},
            root_dir=str(tmp_path / name),
            **options,
        ).fit(module)
        return module.state_dict()

    eager = fit("eager")
    compiled = fit("blocks", compile="blocks")
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], atol=1e-5, rtol=0, msg=key)
    assert "compile: blocks: 4 block(s) compiled one by one (model.transformer.h.0," in caplog.text
    assert "compile: blocks: 1 graph(s) compiled in this fit" in caplog.text, caplog.text
    assert "recompiled" not in caplog.text
    # the whole step compiled with its blocks checkpointed (torch.compile traces the selective policy); blocks
    # compiled with checkpointing: tests/test_model_parallel.py's fsdp run
    compiled = fit("step+selective", compile=True, activation_checkpointing="selective")
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], atol=1e-5, rtol=0, msg=f"step+selective {key}")
