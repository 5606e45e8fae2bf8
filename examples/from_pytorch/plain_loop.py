"""Before: a plain PyTorch training loop on the 8x8 digits (one process, CPU or one GPU).

    python -m examples.from_pytorch.plain_loop            # from the repository root

The same model as a unifit TrainModule (the "after") is examples/from_pytorch/module.py, run by
examples/from_pytorch/exp.yaml. What moves where:

    the model (MLP)                          -> unchanged, imported by module.py
    loss and accuracy in the loop            -> training_step / validation_step, with self.log
    the optimizer                            -> configure_optimizers
    DataLoader, device, epochs, seed         -> the YAML (data class, trainer.batch_size, max_epochs, seed)
    the validation loop, averaging, printing -> unifit (metrics.jsonl, TensorBoard, checkpoints)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from examples.digits.data import DigitsData


class MLP(torch.nn.Module):
    """64 pixels -> hidden -> 10 digits."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main(
    epochs: int = 10,
    batch_size: int = 32,
    lr: float = 0.05,
    hidden: int = 64,
    seed: int = 0,
    save_to: str | None = None,
) -> float:
    """Train, print each epoch's metrics, save the weights to `save_to` if given; the last validation accuracy."""
    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = DigitsData(val_fraction=0.2, split_seed=0)
    train_x, train_y = (torch.from_numpy(a) for a in data.train_dataset())
    val_x, val_y = (torch.from_numpy(a) for a in data.val_dataset())
    train_loader = DataLoader(TensorDataset(train_x, train_y), batch_size=batch_size, shuffle=True)
    val_loader = DataLoader(TensorDataset(val_x, val_y), batch_size=batch_size)

    model = MLP(hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    val_acc = 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        train_loss, seen = 0.0, 0
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            train_loss += loss.item() * len(x)
            seen += len(x)

        model.eval()
        correct, val_loss, total = 0, 0.0, 0
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                logits = model(x)
                val_loss += F.cross_entropy(logits, y, reduction="sum").item()
                correct += (logits.argmax(1) == y).sum().item()
                total += len(x)
        val_acc = correct / total
        print(
            f"epoch {epoch}/{epochs}  train/loss={train_loss / seen:.4f}  "
            f"val/loss={val_loss / total:.4f}  val/acc={val_acc:.4f}"
        )
    if save_to:
        torch.save(model.state_dict(), save_to)
    return val_acc


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a plain PyTorch loop on the digits")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--save-to", default=None, help="a .pt file for the trained weights")
    args = parser.parse_args()
    main(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, save_to=args.save_to)
