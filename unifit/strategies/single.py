"""One process, one device: the default strategy, and what every collective reduces to."""

from __future__ import annotations

from unifit.strategies.base import Strategy
from unifit.strategies.keras_training import KerasTraining
from unifit.strategies.torch_training import TorchTraining


class SingleStrategy(Strategy, TorchTraining, KerasTraining):
    name = "single"
