"""Precision for torch: autocast around the forward, loss scaling around backward and step.

One object per run owns everything that differs between `32-true`, `bf16-mixed` and
`16-mixed`, so the engine's step reads the same for all three (Lightning's precision plugins,
torch.amp underneath). It sits below the strategies, which hold it as Lightning Fabric's Strategy holds its
Precision and ask it what they need (the dtype it computes in, whether it scales the loss), never its name. A step the GradScaler skips because gradients overflowed is normal
under float16 (the scale backs off); a NaN *loss* is still caught by the NaN guard.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

import torch

from unifit.errors import ConfigError, first_line

_PLAIN = contextlib.nullcontext()  # reusable: no per-step allocation in full precision


class Precision:
    """Full precision: every hook is plain."""

    name = "32-true"
    dtype: torch.dtype | None = None  # what the forward computes in (None: the parameters' own dtype)

    @property
    def scales_loss(self) -> bool:
        """The loss is multiplied before backward and the gradients divided again (float16's GradScaler)."""
        return False

    def autocast(self) -> ContextManager[Any]:
        """The region the step's forward runs in. Mixed precision casts without autocast's weight cache, as
        Lightning does: a weight used twice in a step gets each use's gradient back in float32 (with the
        cache they add up in the low precision first), and a step that changes weights inside it (manual
        optimization) never computes with a stale cast copy."""
        return _PLAIN

    def backward(self, loss: torch.Tensor, *args: Any, run: Any = None, **kwargs: Any) -> None:
        """Backward of the loss (scaled, under a loss-scaling precision) through `run(loss, *args, **kwargs)`: the
        module's own backward hook, or Tensor.backward."""
        (run or torch.Tensor.backward)(loss, *args, **kwargs)

    def unscale(self, optimizer: Any) -> None:
        """Bring gradients to their true scale (before clipping)."""

    def step(self, optimizer: Any) -> None:
        optimizer.step()

    def forget_step(self) -> None:
        """A step that failed midway: nothing kept between steps in full precision."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class MixedPrecision(Precision):
    """torch.autocast to `dtype`; float16 adds a GradScaler (bfloat16 has float32's range)."""

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device) -> None:
        self.name, self.dtype, self.device_type = name, dtype, device.type
        _check_supported(name, dtype, device)
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        self._unscaled: set[int] = set()  # optimizers unscaled since their last step (a user's clip, then the step)

    @property
    def scales_loss(self) -> bool:
        return self.scaler is not None

    def autocast(self) -> ContextManager[Any]:
        if self.device_type == "cpu" and self.dtype == torch.float16:
            return _cpu_float16()
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)

    def backward(self, loss: torch.Tensor, *args: Any, run: Any = None, **kwargs: Any) -> None:
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        (run or torch.Tensor.backward)(scaled, *args, **kwargs)

    def unscale(self, optimizer: Any) -> None:
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, optimizer: Any) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skipped when the unscaled gradients hold inf/NaN
        self.scaler.update()
        self._unscaled.discard(id(optimizer))

    def forget_step(self) -> None:
        """A step that failed midway (out of memory in the batch size finder's trial): no optimizer stays half
        unscaled (the scale itself is restored with the rest)."""
        self._unscaled.clear()
        if self.scaler is not None:
            state = self.scaler.state_dict()
            self.scaler = torch.amp.GradScaler(self.device_type)
            self.scaler.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


@contextlib.contextmanager
def _cpu_float16() -> Iterator[None]:
    """Autocast to float16 on CPU, where some layers have no float16 kernel (nn.LSTM: oneDNN 'could not
    create a primitive descriptor'): that error names the setting to change instead."""
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        try:
            yield
        except RuntimeError as exc:
            if "could not create a primitive" not in str(exc):
                raise
            raise ConfigError(
                f"trainer.precision: '16-mixed' on CPU, but a layer of this model has no float16 CPU "
                f"kernel in torch ({first_line(exc)[:60]}...); use 'bf16-mixed' on CPU, or "
                "'16-mixed' on a GPU"
            ) from None


def make_precision(name: str, device: torch.device) -> Precision:
    """The Precision for `trainer.precision` on this device."""
    if name == "32-true":
        return Precision()
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[name]
    return MixedPrecision(name, dtype, device)


def _check_supported(name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse at set-up, in one line, what would fail (or silently run in float32) later."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"trainer.precision: received '{name}', but {torch.cuda.get_device_name(device)} has no "
            "bfloat16 support; use '16-mixed' or '32-true'"
        )
    if not torch.amp.is_autocast_available(device.type):
        raise ConfigError(
            f"trainer.precision: received '{name}', but torch has no autocast for device '{device.type}'; use '32-true'"
        )
    try:
        with torch.autocast(device.type, dtype=dtype):
            torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        if dtype == torch.float16:
            torch.amp.GradScaler(device.type)
    except (RuntimeError, AssertionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"trainer.precision: received '{name}', which torch {torch.__version__} does not support "
            f"on {device.type} ({first}); use '32-true' or 'bf16-mixed'"
        ) from None
