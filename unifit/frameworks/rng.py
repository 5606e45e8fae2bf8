"""Python's and NumPy's random state, shared by every engine (each adds its framework's own)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np


def host_rng_state() -> dict[str, Any]:
    """Plain lists and numbers, so checkpoints need no pickled objects to hold it."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "key": np_state["state"]["key"].tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
    }


def set_host_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )


def seed_host(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _as_tuple(value: Any) -> Any:
    """JSON and torch.load turn random.getstate()'s tuples into lists; setstate needs tuples."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
