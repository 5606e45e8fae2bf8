"""WeightsReport: each rank writes weights_<rank>.json at the end of fit: its rank and world size, how many
parameter elements it holds (its shards under fsdp and model-parallel), and how far they moved since fit began.

Framework-neutral enough for the examples: a torch module (a TrainModule, or unifit's adapter around a
LightningModule) through its parameters, DTensors read as their local shards (no collective), so the
check works the same under every torch strategy."""

from __future__ import annotations

import json
import os
from typing import Any

import unifit


def _local_parameters(module: Any) -> dict[str, Any]:
    import torch

    found = {}
    for holder in (module, getattr(module, "lightning", None)):
        if isinstance(holder, torch.nn.Module):
            for name, param in holder.named_parameters():
                local = param.to_local() if hasattr(param, "to_local") else param
                if not local.is_meta and local.numel():
                    found[name] = local.detach().to("cpu", torch.float64).clone()
            if found:
                break
    return found


class WeightsReport(unifit.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.start: dict[str, Any] = {}

    def on_fit_start(self, ctx) -> None:
        self.start = _local_parameters(ctx.module)

    def on_fit_end(self, ctx) -> None:
        end = _local_parameters(ctx.module)
        compared = [n for n in end if n in self.start and self.start[n].shape == end[n].shape]
        moved = [n for n in compared if not bool((self.start[n] == end[n]).all())]
        report = {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "elements_at_start": sum(t.numel() for t in self.start.values()),
            "elements_at_end": sum(t.numel() for t in end.values()),
            "compared": len(compared),
            "moved": len(moved),
            "max_change": max((float((end[n] - self.start[n]).abs().max()) for n in compared), default=0.0),
            "global_step": ctx.state.global_step,
        }
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"weights_{ctx.rank}.json"), "w") as f:
            json.dump(report, f)


def read_reports(out_dir) -> list[dict]:
    """The reports, by rank."""
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    reports = [json.load(open(os.path.join(out_dir, n))) for n in names if n.startswith("weights_")]
    return sorted(reports, key=lambda r: r["rank"])
