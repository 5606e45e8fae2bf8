"""Lightning's ModelPruning with a random pruning method on several ranks: each rank would draw other masks (unifit
seeds each rank's randomness apart); every rank must end with rank 0's masks and the same weights."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.callbacks import ModelPruning  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

import unifit  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    module = BoringModel()
    pruning = ModelPruning("random_unstructured", amount=0.5, use_lottery_ticket_hypothesis=False)
    unifit.Trainer(max_epochs=2, root_dir=str(out / "run"), progress_bar=False, callbacks=[pruning]).fit(module)
    weight = module.layer.weight.detach()
    digest = hashlib.sha256(weight.numpy().tobytes()).hexdigest()
    zeros = int((weight == 0).sum())
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"digest": digest, "zeros": zeros}))
