"""Distribution strategies (one file each), their registry, environments and launchers."""

from unifit.strategies.base import Strategy
from unifit.strategies.environment import ClusterEnvironment

__all__ = ["Strategy", "ClusterEnvironment"]
