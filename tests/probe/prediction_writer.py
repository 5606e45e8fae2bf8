"""Lightning's prediction writers as their docs write them (each rank saves its own predictions and batch indices),
run by unifit's Trainer.predict(return_predictions=False): `python -m unifit launch ... -- this.py OUT`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.callbacks import BasePredictionWriter  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


class EpochWriter(BasePredictionWriter):
    """Lightning's docs' CustomWriter: every rank's predictions and batch indices at the epoch's end."""

    def __init__(self, output_dir: str) -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = output_dir

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        torch.save(predictions, os.path.join(self.output_dir, f"predictions_{trainer.global_rank}.pt"))
        torch.save(batch_indices, os.path.join(self.output_dir, f"batch_indices_{trainer.global_rank}.pt"))


class BatchWriter(BasePredictionWriter):
    """Each batch as it comes, named by its dataset indices."""

    def __init__(self, output_dir: str) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        torch.save(
            {"indices": batch_indices, "prediction": prediction},
            os.path.join(self.output_dir, f"b{batch_idx}_r{trainer.global_rank}.pt"),
        )


def model_and_data() -> tuple[BoringModel, DataLoader]:
    torch.manual_seed(0)
    return BoringModel(), DataLoader(RandomDataset(32, 21), batch_size=4)  # 21 samples: uneven shards


if __name__ == "__main__":
    import unifit

    out = Path(sys.argv[1])
    model, loader = model_and_data()
    trainer = unifit.Trainer(progress_bar=False, callbacks=[EpochWriter(str(out)), BatchWriter(str(out))])
    assert trainer.predict(model, loader, return_predictions=False) is None
