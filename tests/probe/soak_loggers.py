"""A long soak of the loggers (not in CI: about a minute): 2 ddp ranks (or the strategy named), 100 epochs x 100
steps, tensorboard + csv + mlflow (a real server) + wandb offline, logging every 10 steps; threads, descriptors and
RSS per epoch judged as tests/test_soak.py judges them, and every MLflow point checked.

    .venv/bin/python tests/probe/soak_loggers.py [ddp|horovod|mwms|...]
"""

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tests.test_soak as soak
from tests.helpers import STRATEGY, run_unifit
from tests.test_loggers import MlflowServer, _history, _runs

soak.EPOCHS, soak.WARMUP_EPOCHS = 100, 25
root = Path(tempfile.mkdtemp()) / "run"
root.parent.mkdir(exist_ok=True)
srv = MlflowServer(root.parent)
srv.start()
try:
    case = STRATEGY[sys.argv[1] if len(sys.argv) > 1 else "ddp"]
    loggers = json.dumps(
        [
            "tensorboard",
            "csv",
            {"name": "mlflow", "tracking_uri": srv.uri, "experiment": "soak"},
            {"name": "wandb", "mode": "offline"},
        ]
    )
    t = time.time()
    r = run_unifit(
        *soak.soak_args(case, root),
        "--trainer.loggers",
        loggers,
        "--trainer.tensorboard.log_every_n_steps",
        "10",
        timeout=1500,
    )
    print("rc", r.returncode, "took", round(time.time() - t), "s")
    print(r.stderr[-3000:])
    for f in sorted((root / "resources").glob("resources_*.json")):
        numbers, grew = soak.leaks(json.loads(f.read_text())["samples"], soak.tolerances(case.id))
        print(f.name, json.dumps(numbers), "GREW:" if grew else "flat", grew)
    (run,) = _runs(srv.uri, "soak")
    h = _history(srv.uri, run.info.run_id, "train/loss_step")
    print("mlflow points", len(h), "first", h[0][0], "last", h[-1][0], "status", run.info.status)
    rows = (root / "metrics.csv").read_text().splitlines()
    print("csv rows", len(rows) - 1)
finally:
    srv.stop()
