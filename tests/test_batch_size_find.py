"""trainer.batch_size_find (Lightning's BatchSizeFinder, mapped onto it): the same batch size as Lightning's own
search in both modes, on a module that runs out of memory above a batch size; everything the trials changed put
back (the fit equals a fresh fit at the size found, bit for bit); a resume goes on at the size found; one-line
refusals where it cannot run."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BatchSizeFinder
from torch.utils.data import DataLoader, TensorDataset

import unifit
from tests.helpers import lightning_trainer
from tests.probe.lightning_probe import Regressor
from tests.zoo.own_step_models import GAN, GANData
from unifit.errors import ConfigError
from unifit.frameworks.torch import batch_size_finder

QUIET = {"progress_bar": False, "tensorboard": {"enabled": False}, "lr_scaling": "none"}
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (a test's memory limit)"


class MemoryBound(Regressor):
    """Lightning's tuning example's shape: the DataLoaders read self.batch_size; a step over more than `limit`
    samples runs out of memory, as a GPU would."""

    def __init__(self, limit: int = 50, n: int = 200, batch_size: int = 8, late: bool = False) -> None:
        super().__init__(n=n)
        self.limit, self.batch_size, self.late, self.size = limit, batch_size, late, 0

    def training_step(self, batch, batch_idx):
        self.size = len(batch[0])
        if self.size > self.limit and not self.late:
            raise RuntimeError(OOM)
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        """`late`: out of memory after backward, with the gradients unscaled (16-mixed), as an optimizer's state
        being made at its first step can run out."""
        if self.size > self.limit and self.late:
            raise RuntimeError(OOM)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:40], self.y[:40]), batch_size=self.batch_size)


class OwnLoaders(unifit.TrainModule):
    """A unifit module whose loaders unifit builds: they follow the size found without any attribute."""

    def __init__(self, limit: int = 40) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(160, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.limit = limit

    def training_step(self, batch, batch_idx):
        x, y = batch
        if len(x) > self.limit:
            raise RuntimeError(OOM)
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_mse", F.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataset(self):
        return TensorDataset(self.x, self.y)

    def val_dataset(self):
        return TensorDataset(self.x[:32], self.y[:32])


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mode", "limit", "found", "lightnings"),
    [("power", 50, 32, 32), ("binsearch", 50, 47, 47), ("power", 500, 200, 256)],
)
def test_the_finder_finds_lightnings_batch_size_and_the_fit_then_starts_afresh_at_it(
    tmp_path, mode, limit, found, lightnings
):
    """Power: doubled until 64 runs out of memory, then 32; binsearch: then 48, 56, 52, 50, 51 tried, 50 less 5%;
    a limit above the data: stopped at the training set's 200 samples. Lightning's own finder on the same module
    says the same (except there: it says 256, a batch its loader never gives); the tuned fit equals a fresh fit at
    that batch size."""
    theirs = BatchSizeFinder(mode=mode)
    torch.manual_seed(0)
    lightning_trainer(max_epochs=2, callbacks=[theirs], default_root_dir=str(tmp_path)).fit(MemoryBound(limit))
    assert theirs.optimal_batch_size == lightnings
    options = dict(max_epochs=2, checkpoint={"enabled": False}, **QUIET)
    torch.manual_seed(0)
    ours, tuned = BatchSizeFinder(mode=mode), MemoryBound(limit)
    unifit.Trainer(root_dir=str(tmp_path / "tuned"), callbacks=[ours], **options).fit(tuned)
    assert ours.optimal_batch_size == found and tuned.batch_size == found
    torch.manual_seed(0)
    fresh = MemoryBound(limit, batch_size=found)
    unifit.Trainer(root_dir=str(tmp_path / "fresh"), **options).fit(fresh)
    assert tuned.calls == fresh.calls  # the trials called no hook of the module's twice (setup, on_fit_start...)
    for key, value in _weights(fresh).items():
        assert torch.equal(tuned.state_dict()[key], value), key


@pytest.mark.timeout(180)
def test_unifits_own_loaders_follow_the_size_found_and_a_resume_goes_on_at_it(tmp_path):
    """A unifit module (no batch size attribute: unifit builds its loaders) with trainer.batch_size_find as YAML
    gives it; binsearch over a limit of 40: 32 fits, 64 not, then 48, 40 fit... 40 less 5% is 38. Stopped after
    2 of 3 epochs and resumed (the finder skipped: the checkpoint's batch size goes on), it ends where an
    uninterrupted run at batch size 38 ends."""
    common = dict(checkpoint={"enabled": True}, batch_size=8, **QUIET)
    finder = {"batch_size_find": {"mode": "binsearch", "steps_per_trial": 2}}
    torch.manual_seed(0)
    resumed = OwnLoaders()
    first = unifit.Trainer(max_epochs=2, root_dir=str(tmp_path / "tuned"), **finder, **common)
    first.fit(resumed)
    torch.manual_seed(0)
    resumed = OwnLoaders()  # a new process would start from fresh weights; the checkpoint brings them back
    state = unifit.Trainer(max_epochs=3, root_dir=str(tmp_path / "tuned"), **finder, **common).fit(
        resumed, ckpt_path="last"
    )
    assert state.progress.global_batch == 38 and state.progress.batches_per_epoch == 5  # 160 samples / 38
    torch.manual_seed(0)
    straight = OwnLoaders()
    unifit.Trainer(max_epochs=3, root_dir=str(tmp_path / "straight"), **{**common, "batch_size": 38}).fit(straight)
    for key, value in _weights(straight).items():
        assert torch.equal(resumed.state_dict()[key], value), key


class _Stub:
    """Just enough of a set-up engine for the finder's first check."""

    def __init__(self, world_size: int) -> None:
        self.strategy = types.SimpleNamespace(world_size=world_size, is_global_zero=True)


@pytest.mark.timeout(120)
def test_where_the_finder_cannot_run_it_is_refused_in_one_line(tmp_path):
    settings = unifit.config.schema.BatchSizeFindConfig()
    with pytest.raises(ConfigError, match=r"trainer.batch_size_find: runs on one process \(2 were launched\)"):
        batch_size_finder.find_batch_size(_Stub(world_size=2), settings)
    options = dict(max_epochs=1, root_dir=str(tmp_path), callbacks=[BatchSizeFinder()], **QUIET)
    with pytest.raises(ConfigError, match=r"Regressor has no 'batch_size' \(nor its hparams or data module\)"):
        unifit.Trainer(**options).fit(Regressor())
    module = MemoryBound()
    loader = DataLoader(TensorDataset(module.x, module.y), batch_size=8)
    with pytest.raises(ConfigError, match="the training DataLoader kept batch size 8 when the finder set 2"):
        unifit.Trainer(**options).fit(module, train_dataloaders=loader)
    assert module.batch_size == 8 and len(module.calls) > 0  # put back; the module's hooks had run (setup...)


@pytest.mark.timeout(180)
def test_a_lightning_module_resumes_at_the_size_found_and_a_late_failure_leaves_no_scaler_state(tmp_path):
    """16-mixed, running out of memory after the gradients were unscaled (the last trial fails there): the fit still
    equals a fresh one at the size found (the loss scaler's state put back, no optimizer left unscaled). Resumed
    after 2 of 3 epochs from a fresh module (batch_size 8 again), the run goes on at the size found, its DataLoaders
    rebuilt from the module's attribute, and ends as the uninterrupted run."""
    options = dict(checkpoint={"enabled": True}, precision="16-mixed", **QUIET)

    def run(root, epochs, finder=True, ckpt_path=None, batch_size=8):
        torch.manual_seed(0)
        module = MemoryBound(batch_size=batch_size, late=True)
        callbacks = [BatchSizeFinder()] if finder else []
        trainer = unifit.Trainer(max_epochs=epochs, root_dir=str(root), callbacks=callbacks, **options)
        return module, trainer.fit(module, ckpt_path=ckpt_path)

    tuned, state = run(tmp_path / "tuned", 3)
    assert tuned.batch_size == 32 and state.progress.global_batch == 32
    fresh, _ = run(tmp_path / "fresh", 3, finder=False, batch_size=32)
    for key, value in _weights(fresh).items():
        assert torch.equal(tuned.state_dict()[key], value), key
    run(tmp_path / "part", 2)
    resumed, state = run(tmp_path / "part", 3, ckpt_path="last")
    assert resumed.batch_size == 32 and state.progress.batches_per_epoch == 7
    for key, value in _weights(tuned).items():
        assert torch.equal(resumed.state_dict()[key], value), key


@pytest.mark.timeout(180)
def test_a_gan_stepping_its_optimizers_itself_is_tuned_and_then_trains_as_a_fresh_fit(tmp_path):
    """The zoo's GAN (manual optimization, two optimizers, the discriminator accumulating by hand) with its data
    module's batch_size: nothing runs out of memory, so the trials grow it to the 96 samples; each optimizer's own
    warmup count is put back with the rest, so the fit equals a fresh one at batch size 96."""
    options = dict(max_epochs=2, warmup_epochs=1, lr_scaling="linear", base_batch_size=8, checkpoint={"enabled": False})
    options |= {k: v for k, v in QUIET.items() if k != "lr_scaling"}

    def run(root, batch_size, finder):
        torch.manual_seed(0)
        module, data = GAN(), GANData(batch_size)
        callbacks = [BatchSizeFinder(init_val=4)] if finder else []
        unifit.Trainer(root_dir=str(root), callbacks=callbacks, **options).fit(module, datamodule=data)
        return module, data

    torch.manual_seed(0)
    initial = _weights(GAN())  # what run() starts both fits from
    (tuned, data), (fresh, _) = run(tmp_path / "tuned", 8, True), run(tmp_path / "fresh", 96, False)
    assert data.batch_size == 96
    for key, value in _weights(fresh).items():
        assert torch.equal(tuned.state_dict()[key], value), key
        # both trained (two untrained fits are equal too): the generator steps every batch; the discriminator
        # steps every 2nd batch of an epoch, so never in the one batch of 96 (it must not have stepped either)
        moved = not torch.allclose(value, initial[key], rtol=0, atol=1e-6)
        assert moved == key.startswith("generator."), key
