"""LightningModules that take part in their own optimizer step, written the way Lightning's docs teach it
(docs "Manual Optimization" and "LightningModule hooks"; no Lightning example's code is copied here):

- `GAN`: manual optimization with two optimizers stepped in turn (`self.optimizers()`, `toggle_optimizer`,
  `manual_backward`, `opt.step()`), the discriminator's gradients accumulated by hand over two batches and
  clipped with `self.clip_gradients`, the generator's StepLR stepped by hand at the epoch's end;
- `TwoSourcesClassifier` on `TwoSourcesData`: two training loaders of different sizes in one step (a dict, which
  Lightning combines "max_size_cycle");
- `FinetunedClassifier`: a backbone frozen, then unfrozen at the second epoch by Lightning's BackboneFinetuning (a
  param group added to the optimizer mid-training);
- `BalancedClassifier` on `ImbalancedData`: a class-imbalanced data module whose DataLoader rebalances with a
  `WeightedRandomSampler`;
- `HookedClassifier`: automatic optimization with the hooks inside the step: `on_before_backward`,
  `on_after_backward`, `on_before_optimizer_step` (logging the gradient norm), `on_before_zero_grad`,
  `configure_gradient_clipping` (clipping by value), an `optimizer_step` override that warms the lr up by
  hand (the docs' example), and a scheduler that is not torch's (timm's interface: `step(epoch)`) stepped
  in `lr_scheduler_step`.

Both draw no random numbers while training (the GAN's noise comes with the data), so runs compare step
for step with Lightning's own Trainer and across strategies.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

FEATURES, LATENT = 16, 8


class GANData(L.LightningDataModule):
    """Real samples from a fixed Gaussian mixture, each with the noise its fake sample is made from."""

    def __init__(self, batch_size: int, n: int = 96) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        centres = torch.randn(4, FEATURES, generator=g)
        real = centres[torch.randint(0, 4, (n,), generator=g)] + 0.1 * torch.randn(n, FEATURES, generator=g)
        self.data = TensorDataset(real, torch.randn(n, LATENT, generator=g))
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


class GAN(L.LightningModule):
    def __init__(self, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = torch.nn.Sequential(
            torch.nn.Linear(LATENT, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, FEATURES)
        )
        self.discriminator = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, 1)
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        ones = torch.ones(real.size(0), 1, device=real.device)
        zeros = torch.zeros(real.size(0), 1, device=real.device)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)  # the discriminator: gradients accumulated over 2 batches
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z).detach()), zeros)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss / 2)
        if (batch_idx + 1) % 2 == 0:
            self.clip_gradients(opt_d, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt_d.step()
            opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def on_train_epoch_end(self) -> None:
        self.lr_schedulers().step()

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=(0.5, 0.999))
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.5)]


class CosineEpochs:
    """A scheduler with timm's interface (not a torch LRScheduler): step(epoch) sets each group's lr,
    state_dict/load_state_dict, the optimizer it drives as `.optimizer`, its base lrs as `.base_values`."""

    def __init__(self, optimizer: torch.optim.Optimizer, t_initial: int, lr_min: float = 1e-4) -> None:
        self.optimizer, self.t_initial, self.lr_min = optimizer, t_initial, lr_min
        self.base_values = [group["lr"] for group in optimizer.param_groups]

    def step(self, epoch: int, metric: Any = None) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_values):
            group["lr"] = self.lr_min + 0.5 * (base - self.lr_min) * (1 + math.cos(math.pi * epoch / self.t_initial))

    def state_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class ClassData(L.LightningDataModule):
    def __init__(self, batch_size: int, n: int = 96) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        x = torch.randn(n, FEATURES, generator=g)
        self.data = TensorDataset(x, (x[:, :3].sum(dim=1) > 0).long())
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


class Classifier(L.LightningModule):
    """A small classifier on ClassData, as the docs write one."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
        self.grad_norms: list[float] = []  # the gradients' norm before each optimizer step (the zoo compares them)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_ce", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(dim=1) == y).float().mean())


class HookedClassifier(Classifier):
    WARMUP = 4  # optimizer steps of the hand-written warmup

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.calls: list[str] = []  # the step hooks, in the order they ran

    def on_before_zero_grad(self, optimizer: Any) -> None:
        self.calls.append("on_before_zero_grad")

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.calls.append("on_before_backward")

    def on_after_backward(self) -> None:
        self.calls.append("on_after_backward")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.calls.append("on_before_optimizer_step")
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters() if p.grad is not None]))
        self.grad_norms.append(float(norm))
        self.log("grad_norm", norm)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        self.calls.append("configure_gradient_clipping")
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="value")

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        self.calls.append("optimizer_step")
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < self.WARMUP:  # the docs' hand-written warmup
            scale = min(1.0, float(self.trainer.global_step + 1) / self.WARMUP)
            for group in optimizer.param_groups:
                group["lr"] = scale * self.hparams.lr

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        self.calls.append("lr_scheduler_step")
        scheduler.step(epoch=self.current_epoch + 1)  # timm's schedulers take the epoch

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": CosineEpochs(optimizer, 4), "interval": "epoch"}}


class ImbalancedData(L.LightningDataModule):
    """A class-imbalanced data set (1 sample in 8 of class 1) that its DataLoader rebalances with a
    WeightedRandomSampler, each sample weighted by the inverse of its class's frequency, as the docs teach."""

    def __init__(self, batch_size: int, n: int = 96) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        x = torch.randn(n, FEATURES, generator=g)
        y = (torch.arange(n) % 8 == 0).long()
        x[y == 1] += 1.0
        self.data, self.batch_size = TensorDataset(x, y), batch_size
        counts = torch.bincount(y)
        self.weights = (1.0 / counts.double())[y]

    def train_dataloader(self) -> DataLoader:
        sampler = torch.utils.data.WeightedRandomSampler(self.weights, num_samples=len(self.weights), replacement=True)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


class BalancedClassifier(Classifier):
    """Counts the classes of the samples it trains on (the sampler's rebalancing, seen from the step)."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        self.classes_seen = [0, 0]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        counts = torch.bincount(batch[1], minlength=2)
        self.classes_seen = [a + int(b) for a, b in zip(self.classes_seen, counts)]
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class TwoSourcesData(ClassData):
    """Two training sources of different sizes in every step, as semi-supervised code feeds them: the labelled
    set and a smaller unlabelled one, returned as a dict (Lightning's CombinedLoader, "max_size_cycle": the
    smaller one cycles until the labelled set's epoch ends)."""

    def __init__(self, batch_size: int, n: int = 96, unlabelled: int = 40) -> None:
        super().__init__(batch_size, n)
        self.unlabelled = TensorDataset(torch.randn(unlabelled, FEATURES, generator=torch.Generator().manual_seed(5)))

    def train_dataloader(self) -> Any:
        return {
            "labelled": DataLoader(self.data, batch_size=self.batch_size),
            "unlabelled": DataLoader(self.unlabelled, batch_size=self.batch_size),
        }


class TwoSourcesClassifier(Classifier):
    """Cross-entropy on the labelled batch plus entropy minimisation on the unlabelled one."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch["labelled"]
        (u,) = batch["unlabelled"]
        p = self.net(u).softmax(dim=1)
        loss = F.cross_entropy(self.net(x), y) - 0.1 * (p * p.log()).sum(dim=1).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class FinetunedClassifier(L.LightningModule):
    """Transfer learning as Lightning's docs teach it: a backbone frozen by BackboneFinetuning (from
    configure_callbacks()) and unfrozen at the second epoch, when the callback adds its param group to the
    optimizer; the optimizer takes the trainable parameters only."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.head(self.backbone(x)), y)
        self.log("train_ce", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=self.hparams.lr, momentum=0.9)

    def configure_callbacks(self) -> Any:
        from lightning.pytorch.callbacks import BackboneFinetuning

        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1)]


MODELS = {
    "finetuning": (lambda b: (FinetunedClassifier(), ClassData(b)), False),
    "two-sources": (lambda b: (TwoSourcesClassifier(), TwoSourcesData(b)), False),
    "gan": (lambda b: (GAN(), GANData(b)), False),
    "hooks": (lambda b: (HookedClassifier(), ClassData(b)), False),
    "imbalanced": (lambda b: (BalancedClassifier(), ImbalancedData(b)), False),
}
# drawn by a sampler of the user's: under unifit from a random state every rank shares (seeded by trainer.seed and
# the epoch), under Lightning from the global generator, so the batches differ from Lightning's and between world sizes
SAMPLED = {"imbalanced"}
MANUAL = {"gan"}  # manual optimization: Lightning and unifit refuse accumulate_grad_batches with it
