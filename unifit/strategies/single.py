"""One process, one device: the default strategy, and what every collective reduces to.

Its training parts are the plain ones (registry row): TorchTraining and KerasTraining as they are.
"""

from __future__ import annotations

from unifit.strategies.base import Strategy


class SingleStrategy(Strategy):
    name = "single"
