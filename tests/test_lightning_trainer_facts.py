"""What `self.trainer` tells an unchanged LightningModule in setup() and configure_optimizers(), before the loop
starts, is what Lightning's own Trainer tells it: the tutorials size their schedules from it
(`OneCycleLR(epochs=self.trainer.max_epochs, steps_per_epoch=...)`, Lightning's CIFAR-10 baseline)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import unifit
from tests.helpers import lightning_trainer

FACTS = (
    "max_epochs",
    "max_steps",
    "precision",
    "gradient_clip_val",
    "accumulate_grad_batches",
    "check_val_every_n_epoch",
    "val_check_interval",
    "world_size",
    "global_rank",
    "is_global_zero",
    "num_nodes",
    "current_epoch",
    "global_step",
)


class OneCycleTutorial(BoringModel):
    """BoringModel with the CIFAR-10 baseline tutorial's schedule, recording what self.trainer says."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, dict] = {}

    def _record(self, where: str) -> None:
        self.seen[where] = {name: getattr(self.trainer, name) for name in FACTS}
        self.seen[where]["default_root_dir"] = str(self.trainer.default_root_dir)

    def setup(self, stage: str) -> None:
        self._record("setup")

    def configure_optimizers(self):
        self._record("configure_optimizers")
        self.seen["configure_optimizers"]["estimated_stepping_batches"] = self.trainer.estimated_stepping_batches
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        steps_per_epoch = 64 // 4  # the tutorial's 45000 // BATCH_SIZE
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, 0.1, epochs=self.trainer.max_epochs, steps_per_epoch=steps_per_epoch
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 32)), batch_size=4)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 32)), batch_size=4)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch[0], batch_idx)

    def validation_step(self, batch, batch_idx):
        return super().validation_step(batch[0], batch_idx)


@pytest.mark.timeout(120)
def test_self_trainer_in_setup_and_configure_optimizers_is_lightnings(tmp_path):
    options = {"max_epochs": 2, "accumulate_grad_batches": 2, "gradient_clip_val": 0.5, "precision": "bf16-mixed"}
    torch.manual_seed(0)
    theirs = OneCycleTutorial()
    lightning_trainer(default_root_dir=str(tmp_path / "lightning"), **options).fit(theirs)
    torch.manual_seed(0)
    ours = OneCycleTutorial()
    state = unifit.Trainer(
        root_dir=str(tmp_path / "unifit"), progress_bar=False, tensorboard={"enabled": False}, **options
    ).fit(ours)
    assert state.global_step == 2 * 64 // 4 // 2  # the schedule was built, and stepped through the fit
    for where in ("setup", "configure_optimizers"):
        mine, lightnings = dict(ours.seen[where]), dict(theirs.seen[where])
        assert mine.pop("default_root_dir") == str(tmp_path / "unifit")
        assert lightnings.pop("default_root_dir") == str(tmp_path / "lightning")
        assert mine == lightnings, where
    assert ours.seen["configure_optimizers"]["max_epochs"] == 2


def test_a_value_error_in_configure_optimizers_names_its_line_not_only_init_args(tmp_path):
    class NoEpochs(OneCycleTutorial):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            return torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, epochs=None, steps_per_epoch=8)

    with pytest.raises(unifit.ConfigError) as caught:
        unifit.Trainer(root_dir=str(tmp_path), progress_bar=False, max_epochs=1).fit(NoEpochs())
    message = str(caught.value)
    assert "NoEpochs.configure_optimizers() raised ValueError at " in message
    assert "test_lightning_trainer_facts.py:" in message and "self.trainer" in message
