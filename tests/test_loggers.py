"""Loggers with real backends: a real `mlflow server` (sqlite store, artifacts served over HTTP) on 127.0.0.1 read back
through mlflow.MlflowClient, W&B in offline mode read back from its own run file with wandb's own protobufs, and
Lightning-compatible metrics.csv. The server is stopped mid-run and restarted (the run finishes, nothing is lost), a
resumed fit continues the same tracked run without a step twice, an unreachable server is one line and exit 2 before
anything trains, one tracked run is written by rank 0 under ddp, horovod and mwms, and credentials in the tracking
URI reach no file, param or output."""

from __future__ import annotations

import csv
import glob
import json
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import unifit
from tests.helpers import assert_ok, launch_probe, run_unifit
from tests.probe.lightning_probe import Regressor

mlflow = pytest.importorskip("mlflow", reason="mlflow is in unifit[tracking]: scripts/setup.sh test installs it")
SECRET = "s3cr3t-t0ken"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1 with a sqlite store and artifacts it serves itself; stop() and start() again."""

    def __init__(self, root: Path) -> None:
        self.root, self.port, self.proc = root, _free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> None:
        cmd = [
            *(os.path.join(os.path.dirname(sys.executable), "mlflow"), "server"),
            *("--backend-store-uri", f"sqlite:///{self.root}/mlflow.db"),
            *("--artifacts-destination", str(self.root / "artifacts")),
            *("--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"),
        ]
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        if wait:
            self.wait_up()

    def wait_up(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return
            except OSError:
                assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
                time.sleep(0.25)
        raise AssertionError(f"mlflow server not up after {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    yield srv
    srv.stop()


def _runs(uri: str, experiment: str) -> list:
    client = mlflow.MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mlflow.MlflowClient(uri).get_metric_history(run_id, key))


def _csv_rows(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _wandb_records(run_dir: str) -> list:
    """Records of an offline run's .wandb file, parsed with wandb's own protobufs (the file is a leveldb-style log:
    a 7-byte ':W&B' header, then records in 32 KiB blocks, each chunk with a crc32, length and full/first/last kind)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(glob.glob(f"{run_dir}/run-*.wandb")[0]).read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or last of a split record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_history(run_dir: str) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for record in _wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            values = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
            }
            steps[values["_step"]] = values
    return steps


class Outage(unifit.Callback):
    """Stops the tracking server after the first epoch and starts it again (not waiting) after the third."""

    def __init__(self, server: MlflowServer) -> None:
        self.server = server

    def on_epoch_end(self, ctx) -> None:
        if ctx.state.epoch == 1:  # epochs done
            self.server.stop()
        elif ctx.state.epoch == 3:
            self.server.start(wait=False)


class TrackedRegressor(Regressor):
    """Lightning code as written for MLflowLogger: `self.logger.experiment` is an MlflowClient."""

    def on_train_epoch_end(self) -> None:
        if self.current_epoch == 0:  # before the outage: the module's own calls go straight to the server
            self.logger.experiment.set_tag(self.logger.run_id, "module_epoch", str(self.current_epoch))
        self.loggers[1].experiment.summary["module_epoch"] = self.current_epoch  # the wandb run


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_mlflow_survives_an_outage_wandb_and_csv_agree_and_a_resume_continues_the_same_runs(
    server, tmp_path, capfd, caplog
):
    uri = server.uri.replace("http://", f"http://unifit:{SECRET}@")
    loggers = [
        {"name": "mlflow", "tracking_uri": uri, "experiment": "outage", "log_checkpoints": True},
        {"name": "wandb", "mode": "offline", "project": "unifit-test", "log_checkpoints": True},
        "csv",
    ]
    options = dict(
        root_dir=str(tmp_path / "run"),
        loggers=loggers,
        tensorboard={"log_every_n_steps": 2},
        progress_bar=False,
        lr_scaling="none",
        batch_size=8,
        checkpoint={"keep_last_n": 5},
    )
    unifit.Trainer(max_epochs=4, callbacks=[Outage(server)], **options).fit(TrackedRegressor())
    server.wait_up()
    out, err = capfd.readouterr()
    assert "failing" in caplog.text and "recovered" in caplog.text, caplog.text  # the outage was real

    (run,) = _runs(server.uri, "outage")
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.max_epochs"] == "4" and run.data.tags["module_epoch"] == "0"
    assert all(SECRET not in str(v) for v in run.data.params.values())
    loss = _history(server.uri, run_id, "train/loss_step")
    assert [s for s, _ in loss] == list(range(2, 33, 2))  # every second step of 4 x 8, once: nothing lost in the outage
    assert [(s, v) for s, v in _history(server.uri, run_id, "epoch")] == [(8, 1), (16, 2), (24, 3), (32, 4)]
    artifacts = {a.path for a in mlflow.MlflowClient(server.uri).list_artifacts(run_id)}
    assert {"config.yaml", "checkpoints"} <= artifacts
    checkpoint = mlflow.MlflowClient(server.uri).list_artifacts(run_id, "checkpoints")
    assert len(checkpoint) == 1 and mlflow.MlflowClient(server.uri).list_artifacts(run_id, checkpoint[0].path)

    header, rows = _csv_rows(tmp_path / "run" / "metrics.csv")  # Lightning's CSVLogger layout
    assert header == sorted(header) and {"epoch", "step", "train/loss_step", "val_mse", "lr_step"} <= set(header)
    csv_loss = [(int(r["step"]), float(r["train/loss_step"])) for r in rows if r["train/loss_step"]]
    assert csv_loss == loss  # the same values at the same steps as MLflow's

    (wandb_dir,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*"))
    history = _wandb_history(wandb_dir)
    assert [(s, history[s]["train/loss_step"]) for s in sorted(history) if "train/loss_step" in history[s]] == loss
    (meta,) = [r.run for r in _wandb_records(wandb_dir) if r.WhichOneof("record_type") == "run"]
    summary = {
        u.key: json.loads(u.value_json)
        for r in _wandb_records(wandb_dir)
        if r.WhichOneof("record_type") == "summary"
        for u in r.summary.update
    }
    assert summary["module_epoch"] == 3  # the module's own write through self.loggers[1].experiment
    (artifact,) = [r.artifact for r in _wandb_records(wandb_dir) if r.WhichOneof("record_type") == "artifact"]
    assert artifact.type == "model" and "COMMITTED.json" in {entry.path for entry in artifact.manifest.contents}
    config = {u.key: json.loads(u.value_json) for u in meta.config.update}
    assert config["trainer.max_epochs"] == 4 and SECRET not in json.dumps(config)
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".csv", ".jsonl", ".json"):
            assert SECRET not in path.read_text(errors="replace"), path
    assert SECRET not in out + err + caplog.text

    # resume from the checkpoint of epoch 2 (the run has logged 2 epochs past it) and go on to 6 epochs
    (older,) = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.endswith("step=0000016")]
    unifit.Trainer(max_epochs=6, **options).fit(TrackedRegressor(), ckpt_path=older)
    (again,) = _runs(server.uri, "outage")
    assert again.info.run_id == run_id and again.info.status == "FINISHED"
    assert [s for s, _ in _history(server.uri, run_id, "train/loss_step")] == list(range(2, 49, 2))
    assert [s for s, _ in _history(server.uri, run_id, "epoch")] == [8, 16, 24, 32, 40, 48]
    _, rows = _csv_rows(tmp_path / "run" / "metrics.csv")
    steps = [int(r["step"]) for r in rows if r["train/loss_step"]]
    assert steps == list(range(2, 49, 2))  # the rows after the checkpoint were replaced, not repeated
    resumed = [d for d in glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*")) if d != wandb_dir]
    assert len(resumed) == 1 and resumed[0].endswith(wandb_dir.rsplit("-", 1)[-1])  # the same wandb run id
    # offline, wandb cannot know the steps the run logged past the checkpoint: they are logged again from it, with
    # the values they had (the resume is exact), in the resumed run's own offline directory
    again_history = {s: v["train/loss_step"] for s, v in _wandb_history(resumed[0]).items() if "train/loss_step" in v}
    assert sorted(again_history) == list(range(18, 49, 2))

    # validating the last checkpoint adds its metrics to the same tracked run, at that checkpoint's step
    metrics = unifit.Trainer(**options).validate(TrackedRegressor(), ckpt_path="last")
    (evaluated,) = _runs(server.uri, "outage")
    assert evaluated.info.run_id == run_id and evaluated.info.status == "FINISHED"
    val = _history(server.uri, run_id, "val_mse")
    assert [s for s, _ in val].count(48) == 2 and metrics["val_mse"] in [v for s, v in val if s == 48]
    _, rows = _csv_rows(tmp_path / "run" / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["val_mse"]][-2:] == [48, 48]  # kept every row, added one
    assert [again_history[s] for s in range(18, 33, 2)] == pytest.approx([v for s, v in loss if s > 16], rel=1e-5)


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_an_unreachable_server_or_an_unknown_logger_is_one_line_and_exit_2_before_training(tmp_path):
    dead = f"http://unifit:{SECRET}@127.0.0.1:{_free_port()}"
    for loggers, needle in (
        (f'[{{name: mlflow, tracking_uri: "{dead}"}}]', "trainer.loggers.0.tracking_uri: the MLflow server at"),
        (f'[csv, {{name: mlflow, tracking_uri: "{dead}"}}, mlfow]', "item 2: received 'mlfow'"),
        (
            "[{name: mlflow, trackin_uri: x}]",
            "unknown key 'trainer.loggers.0.trackin_uri' (did you mean 'tracking_uri'?)",
        ),
        (f'[{{name: mlfow, tracking_uri: "{dead}"}}]', "item 0: received"),
    ):
        result = run_unifit(
            "fit", "-c", "tests/probe/probe.yaml", "--trainer.root_dir", str(tmp_path), "--trainer.loggers", loggers
        )
        assert result.returncode == 2, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], result.stderr
        assert SECRET not in result.stderr + result.stdout
        assert not (tmp_path / "checkpoints").exists()


@pytest.mark.launch
@pytest.mark.tf
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "horovod", "mwms"])
def test_one_tracked_run_written_by_rank_0(server, tmp_path, strategy):
    if strategy == "horovod":
        pytest.importorskip("horovod.torch", reason="horovod is built by scripts/setup.sh test")
    loggers = f'[csv, {{name: mlflow, tracking_uri: "{server.uri}", experiment: ranks-{strategy}}}]'
    result = launch_probe(strategy, tmp_path, "--trainer.loggers", loggers)
    assert_ok(result)
    (run,) = _runs(server.uri, f"ranks-{strategy}")
    assert run.data.params["trainer.strategy"] == strategy and run.info.status == "FINISHED"
    epochs = _history(server.uri, run.info.run_id, "epoch")
    assert [v for _, v in epochs] == [1, 2, 3]
    _, rows = _csv_rows(tmp_path / "metrics.csv")
    steps = [(int(r["step"]), r["epoch"]) for r in rows]
    assert len(steps) == len(set(steps))  # one writer
    assert [s for s, e in steps if e] == [s for s, _ in epochs]


@pytest.mark.timeout(120)
def test_lightning_loggers_run_as_they_are_and_unifits_csv_matches_lightnings(tmp_path):
    """A Lightning CSVLogger object given to the Trainer is driven as Lightning drives it; unifit's own `csv` gets the
    same calls and writes the same file (columns and values), and `self.logger` is the first of them."""
    from lightning.pytorch.loggers import CSVLogger

    seen = []

    class Module(Regressor):
        def on_train_epoch_end(self) -> None:
            seen.append((type(self.logger).__module__, len(self.loggers), self.logger.log_dir))

    lightning_csv = CSVLogger(tmp_path / "lightning")
    trainer = unifit.Trainer(
        root_dir=str(tmp_path / "run"),
        max_epochs=2,
        loggers=["csv", lightning_csv],
        tensorboard={"log_every_n_steps": 3},
        progress_bar=False,
        lr_scaling="none",
        checkpoint={"enabled": False},
    )
    trainer.fit(Module())
    ours = _csv_rows(tmp_path / "run" / "metrics.csv")
    theirs = _csv_rows(Path(lightning_csv.log_dir) / "metrics.csv")
    assert ours == theirs and ours[1]  # same header, same rows
    assert [int(r["step"]) for r in ours[1] if r["train/loss_step"]] == [3, 6, 9, 12, 15]
    trainer.validate(Module())  # after the fit, into the fit's loggers: rows are added, none dropped
    header, after = _csv_rows(tmp_path / "run" / "metrics.csv")
    assert after[: len(ours[1])] == ours[1] and len(after) == len(ours[1]) + 1 and after[-1]["step"] == "16"
    hparams = (Path(lightning_csv.log_dir) / "hparams.yaml").read_text()
    assert "trainer.max_epochs: 2" in hparams  # the resolved config, once
    assert seen == [("unifit.loggers.csv", 2, str(tmp_path / "run"))] * 2


def test_a_lightning_cli_files_loggers_become_unifits():
    from unifit.config.lightning_cli import from_lightning_cli

    run = from_lightning_cli(
        {
            "model": {"class_path": "tests.probe.lightning_probe.Regressor"},
            "trainer": {
                "logger": [
                    {
                        "class_path": "lightning.pytorch.loggers.MLFlowLogger",
                        "init_args": {
                            "experiment_name": "exp",
                            "tracking_uri": "http://127.0.0.1:5000",
                            "log_model": True,
                        },
                    },
                    {
                        "class_path": "lightning.pytorch.loggers.WandbLogger",
                        "init_args": {"project": "p", "offline": True},
                    },
                    {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "logs"}},
                    {"class_path": "my_pkg.CometLike", "init_args": {"project": "q"}},
                ]
            },
        },
        "cli.yaml",
    )
    assert run.experiment["trainer"]["loggers"] == [
        {"name": "mlflow", "experiment": "exp", "tracking_uri": "http://127.0.0.1:5000", "log_checkpoints": True},
        {"name": "wandb", "project": "p", "mode": "offline", "log_checkpoints": False},
        {"name": "csv", "path": "logs/metrics.csv"},
        {"class_path": "my_pkg.CometLike", "init_args": {"project": "q"}},
    ]


@pytest.mark.timeout(120)
def test_a_unifit_module_logs_through_self_logger(tmp_path):
    """`self.logger.experiment` in a unifit TrainModule is TensorBoard's SummaryWriter; what it writes is read back
    with TensorBoard's own reader, beside unifit's scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.probe.probe import ProbeModule

    class Probe(ProbeModule):
        def training_step(self, batch, batch_idx):
            if batch_idx == 0:
                self.logger.experiment.add_histogram("probe/weights", self.net[0].weight.detach(), batch_idx)
            return super().training_step(batch, batch_idx)

    unifit.Trainer(root_dir=str(tmp_path), max_epochs=2, progress_bar=False, checkpoint={"enabled": False}).fit(Probe())
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    assert "probe/weights" in events.Tags()["histograms"] and len(events.Histograms("probe/weights")) == 2
    assert [e.value for e in events.Scalars("epoch")] == [1, 2]


@pytest.mark.launch
@pytest.mark.tf
@pytest.mark.timeout(180)
def test_a_compiled_keras_model_logs_to_the_same_loggers(server, tmp_path):
    pytest.importorskip("tensorflow", reason="TensorFlow is in unifit[tf]")
    from tests.probe.keras_compiled_probe import arrays, compiled_model

    loggers = ["csv", {"name": "mlflow", "tracking_uri": server.uri, "experiment": "keras"}]
    data = {"train": arrays(32, seed=1), "val": arrays(12, seed=2)}
    unifit.Trainer(
        max_epochs=3,
        batch_size=8,
        root_dir=str(tmp_path),
        progress_bar=False,
        loggers=loggers,
        tensorboard={"log_every_n_steps": 2},
    ).fit(compiled_model(), data=data)
    (run,) = _runs(server.uri, "keras")
    loss = _history(server.uri, run.info.run_id, "train/loss_step")
    assert [s for s, _ in loss] == [2, 4, 6, 8, 10, 12] and run.info.status == "FINISHED"
    _, rows = _csv_rows(tmp_path / "metrics.csv")
    assert [(int(r["step"]), float(r["train/loss_step"])) for r in rows if r["train/loss_step"]] == loss
    assert [int(r["epoch"]) for r in rows if r["epoch"]] == [1, 2, 3] and any(r.get("val/loss") for r in rows)


@pytest.mark.timeout(60)
def test_online_wandb_without_a_login_is_one_line_before_training(tmp_path, monkeypatch):
    from unifit.errors import ConfigError

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    trainer = unifit.Trainer(root_dir=str(tmp_path), max_epochs=1, progress_bar=False, loggers=[{"name": "wandb"}])
    with pytest.raises(ConfigError, match=r"trainer.loggers.0: mode 'online' and no wandb login"):
        trainer.fit(Regressor())
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "wandb").exists()


@pytest.mark.launch
def test_a_checkpoints_run_missing_on_the_server_is_a_warning_and_a_new_run(server, tmp_path, caplog):
    from unifit.loggers.base import RunInfo
    from unifit.loggers.mlflow import MLflowLogger

    logger = MLflowLogger(tracking_uri=server.uri, experiment="moved")
    logger.load_state_dict({"run_id": "0" * 32})  # e.g. a checkpoint from another tracking server
    logger.start(RunInfo(str(tmp_path), {"trainer.max_epochs": 1}, resumed_at_step=8, storage_options={}))
    logger.log_metrics({"loss": 0.5}, 9)
    logger.finish("success")
    (run,) = _runs(server.uri, "moved")
    assert run.info.run_id == logger.run_id != "0" * 32 and "is not on" in caplog.text
    assert _history(server.uri, logger.run_id, "loss") == [(9, 0.5)]


@pytest.mark.launch
def test_a_resumed_run_sends_again_only_what_differs_and_names_lose_what_mlflow_refuses(server, tmp_path):
    """After a resume, a point the run already has is sent again only with another value (resumed with other
    settings); a name MLflow refuses loses those characters instead of holding up every record after it."""
    from unifit.loggers.base import RunInfo
    from unifit.loggers.mlflow import MLflowLogger

    first = MLflowLogger(tracking_uri=server.uri, experiment="values")
    first.start(RunInfo(str(tmp_path), {"a": 1}, resumed_at_step=None, storage_options={}))
    for step in (1, 2, 3, 4):
        first.log_metrics({"loss": float(step)}, step)
    first.finish("success")
    again = MLflowLogger(tracking_uri=server.uri, experiment="values")
    again.load_state_dict(first.state_dict())
    again.start(RunInfo(str(tmp_path), {"a": 1}, resumed_at_step=2, storage_options={}))
    again.log_metrics({"loss": 3.0, "acc@1": 0.5}, 3)  # the same value at step 3; a name with '@'
    again.log_metrics({"loss": 40.0}, 4)  # another value at step 4
    again.finish("success")
    assert _history(server.uri, first.run_id, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (4, 40.0)]
    assert _history(server.uri, first.run_id, "acc1") == [(3, 0.5)]


def test_no_op_experiments_take_lightnings_idioms_and_a_module_keeps_its_own_logger():
    import logging as stdlib_logging

    from tests.probe.probe import ProbeModule
    from unifit.loggers.base import NoOpExperiment

    experiment = NoOpExperiment()
    experiment.add_image("x", None, 0)
    experiment.summary["k"] = 1
    experiment["runs"].append(3)
    assert experiment.anything.deeper(1)[0] is experiment

    class OwnLogger(ProbeModule):
        def __init__(self) -> None:
            super().__init__()
            self.logger = stdlib_logging.getLogger("mine")

    module = OwnLogger()
    module.use_loggers(["run's"])
    assert module.logger is stdlib_logging.getLogger("mine") and module.loggers == ["run's"]


def test_a_tensorboard_log_dir_that_is_a_url_is_written_locally_and_synced_there():
    """Event files are appended to while training runs, which object stores cannot do: a URL as log_dir is
    written to a temporary local directory and mirrored there (as sync_to; tests/test_s3.py syncs for real)."""
    config = unifit.Trainer(tensorboard={"log_dir": "s3://b/tb"}).config
    assert (config.tensorboard_dir, config.tensorboard_sync_to) == (None, "s3://b/tb")
    local = unifit.Trainer(tensorboard={"log_dir": "tb", "sync_to": "s3://b/tb"}).config
    assert (local.tensorboard_dir, local.tensorboard_sync_to) == ("tb", "s3://b/tb")
