"""Write what validate/test/predict produced (local or any fsspec URL): predictions in the format
the file's suffix names, metrics as JSON with every digit."""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

from unifit.errors import ConfigError
from unifit.storage import filesystem

_FORMATS = ".pt (torch.save), .npy (numpy arrays) or .pkl (pickle, anything)"


def write_predictions(predictions: Any, url: str, storage_options: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    if url.endswith(".pt"):
        import torch

        torch.save(predictions, buffer)
    elif url.endswith(".npy"):
        import numpy as np

        try:
            np.save(buffer, np.asarray(predictions), allow_pickle=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"--output {url}: the predictions are not one array ({exc}); use .pkl or .pt") from None
    elif url.endswith(".pkl"):
        pickle.dump(predictions, buffer)
    else:
        raise ConfigError(f"--output {url}: unknown format; end the name in {_FORMATS}")
    _write(url, buffer.getvalue(), storage_options)


def write_metrics(metrics: dict[str, float], checkpoint: str | None, url: str, storage_options: dict[str, Any]) -> None:
    _write(url, json.dumps({"metrics": metrics, "checkpoint": checkpoint}, indent=1).encode(), storage_options)


def _write(url: str, data: bytes, storage_options: dict[str, Any]) -> None:
    fs, path = filesystem(url, storage_options)
    parent = path.rsplit("/", 1)[0]
    if parent and parent != path:
        fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(path, data)
