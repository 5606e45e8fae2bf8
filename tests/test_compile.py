"""trainer.compile: true runs the torch step through torch.compile and trains the same model."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(400)
def test_compiled_step_trains_like_the_eager_one(tmp_path):
    import torch
    from torch._dynamo.utils import counters

    import unifit
    from tests.probe.probe import ProbeModule

    results = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        module = ProbeModule(dropout=0.0)  # inductor draws dropout masks from its own generator
        state = unifit.Trainer(
            max_epochs=2,
            batch_size=8,
            compile=compiled,
            root_dir=str(tmp_path / str(compiled)),
            progress_bar=False,
            checkpoint={"enabled": False},
            tensorboard={"enabled": False},
        ).fit(module)
        results[compiled] = (state.metrics, [w.copy() for w in module.weights()])
        graphs = counters["stats"]["unique_graphs"]
        assert (graphs >= 1) if compiled else (graphs == 0), dict(counters["stats"])  # really compiled, or not
    eager, compiled = results[False], results[True]
    assert compiled[0]["train/loss"] == pytest.approx(eager[0]["train/loss"], rel=1e-4)
    assert compiled[0]["val/loss"] == pytest.approx(eager[0]["val/loss"], rel=1e-4)
    for a, b in zip(eager[1], compiled[1]):
        assert abs(a - b).max() < 1e-4
