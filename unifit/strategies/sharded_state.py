"""Sharded model and optimizer state on any fsspec location, with torch.distributed.checkpoint (DCP).

A sharded strategy (fsdp) writes each rank's shards itself: `start_save` copies this rank's local
shards to host memory now (a snapshot: later steps cannot change it) and writes them on DCP's
background thread, every rank into the same directory, rank 0 last with DCP's `.metadata`. Reading
goes two ways: into a sharded model of any world size (DCP reshards: `load_into`), or whole, into one
process (`read_whole`: for ddp, single, validate/test/predict and the consolidated export). Optimizer
state is keyed by parameter name (FQN) in these files; `by_name`/`by_index` convert from and to
torch's own `optimizer.state_dict()` numbering, so a ddp checkpoint resumes under fsdp and back.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

SHARDS = "shards"  # the DCP directory inside a checkpoint directory; its key in the saved engine state


def locate(state: dict[str, Any], directory: str) -> None:
    """In a checkpoint read from `directory`: where its shards are (a URL every rank can use), if it has any."""
    if SHARDS in state:
        state[SHARDS] = f"{directory}/{SHARDS}"


def state_module(module: Any) -> Any:
    """The module whose parameter names a checkpoint uses (TrainModule.state_module; a plain module itself)."""
    return getattr(module, "state_module", module)


def start_save(state: dict[str, Any], url: str, storage_options: dict[str, Any], group: Any) -> Future:
    """Write `state` (DTensors and plain values) under `url` on every rank; returns when this rank's
    shards are copied to host memory, the write goes on in the background (the Future)."""
    import torch.distributed.checkpoint as dcp

    from unifit.strategies.torch_compat import fsspec_writer

    return dcp.async_save(state, storage_writer=fsspec_writer(url, **storage_options), process_group=group)


def load_into(state: dict[str, Any], url: str, storage_options: dict[str, Any], group: Any) -> None:
    """Fill `state` (this rank's sharded model and optimizer state dicts, any world size) in place from `url`."""
    import torch.distributed.checkpoint as dcp

    from unifit.strategies.torch_compat import fsspec_reader

    dcp.load(state, storage_reader=fsspec_reader(url, **storage_options), process_group=group)


def read_whole(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """The full, unsharded state saved under `url`, in this process only (no collective)."""
    from unifit.strategies.torch_compat import load_whole

    return load_whole(url, **storage_options)


def by_name(optimizer_state: dict[str, Any], optimizer: Any, module: Any) -> dict[str, Any]:
    """torch's index-keyed `optimizer.state_dict()` keyed by parameter name instead, the form
    torch.distributed.checkpoint.state_dict reads. Indices count the optimizer's parameters in
    group order, which is the order of `optimizer.param_groups` here as where it was saved."""
    names = _names_in_group_order(optimizer, module)
    return {
        "state": {names[i]: s for i, s in optimizer_state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]],
    }


def by_index(optimizer_state: dict[str, Any], optimizer: Any, module: Any) -> dict[str, Any]:
    """The inverse of `by_name`: what `optimizer.load_state_dict` takes."""
    index = {name: i for i, name in enumerate(_names_in_group_order(optimizer, module))}
    return {
        "state": {index[n]: s for n, s in optimizer_state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optimizer_state["param_groups"]],
    }


def _names_in_group_order(optimizer: Any, module: Any) -> list[str]:
    names = {id(p): n for n, p in state_module(module).named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
