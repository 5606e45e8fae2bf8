"""test, then predict (then validate, if asked) with a checkpoint's weights, in ONE process per rank: what
`unifit launch --run test` and `--run predict` do in two launches, through the Python API (Trainer.test,
Trainer.predict, Trainer.validate), so a test pays for one process start per strategy (TensorFlow's take
seconds each). Each stage gets a fresh module, built from the experiment file as `unifit test` builds it.

    unifit launch --nproc-per-node 2 --strategy ddp -- tests/probe/evaluate_both.py \
        -c tests/probe/probe.yaml --out DIR [--ckpt-path last] [--validate best] [--trainer.x y ...]

Rank 0 writes DIR/test.json and DIR/validate.json ({"metrics": ...}, every digit) and DIR/predictions.pkl
(the predictions, in dataset order).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.probe

from unifit import Trainer  # noqa: E402
from unifit.cli.main import load_experiment, parse_overrides  # noqa: E402
from unifit.config.init_args import build  # noqa: E402
from unifit.strategies import environment  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-path", default="last", help="the checkpoint test and predict use")
    parser.add_argument("--validate", default=None, help="also validate, with this checkpoint (e.g. best)")
    args, extra = parser.parse_known_args()
    experiment = load_experiment(args.config, parse_overrides(extra))
    trainer = Trainer(experiment.trainer)  # one per process, as the command line makes one

    def module():  # a fresh one per stage, as each `unifit test` / `unifit predict` process builds its own
        return build(experiment.module.class_path, experiment.module.init_args, "module")

    results = {"test": trainer.test(module(), ckpt_path=args.ckpt_path)}
    predictions = trainer.predict(module(), ckpt_path=args.ckpt_path)
    if args.validate:
        results["validate"] = trainer.validate(module(), ckpt_path=args.validate)
    if environment.detect().rank != 0:
        assert predictions is None, "predictions on a rank other than 0"
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stage, metrics in results.items():
        (out / f"{stage}.json").write_text(json.dumps({"metrics": metrics}, indent=1))
    (out / "predictions.pkl").write_bytes(pickle.dumps(predictions))
    print(f"evaluate_both: {', '.join(results)} and {len(predictions)} predictions written to {out}", flush=True)


if __name__ == "__main__":
    main()
