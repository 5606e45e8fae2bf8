"""One process, one device: the default strategy, and what every collective reduces to."""

from __future__ import annotations

from unifit.strategies.base import Strategy


class SingleStrategy(Strategy):
    name = "single"
