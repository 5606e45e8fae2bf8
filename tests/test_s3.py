"""S3 everywhere, against a real S3 endpoint over HTTP (moto server on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, STRATEGY_PROCS, assert_ok, launch_probe, probe_args, run_unifit, start_unifit
from tests.probe.gates import held, open_gate

pytestmark = pytest.mark.timeout(300)


def _s3_lines(fs, url: str) -> list[dict]:
    return [json.loads(line) for line in fs.cat_file(url).decode().splitlines() if line]


def _tb_scalars(fs, url: str, local: Path) -> dict[str, list[tuple[int, float]]]:
    """Download the synced event files and read them with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fs.invalidate_cache()
    fs.get(url.rstrip("/") + "/", str(local), recursive=True)
    acc = EventAccumulator(str(local))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.launch
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])  # fsdp: every rank writes its shards to S3
def test_checkpoints_and_logs_in_s3_and_resume_from_s3(s3_endpoint, bucket, tmp_path, strategy):
    fs = s3_endpoint.fs()
    full, part = f"s3://{bucket}/full", f"s3://{bucket}/part"
    common = ["--trainer.tensorboard.sync_every_s", "0.5"]
    assert_ok(
        launch_probe(
            strategy, full, "--trainer.max_epochs", "4", *common, report_dir=tmp_path / "full", env=s3_endpoint.env
        )
    )
    assert_ok(
        launch_probe(
            strategy, part, "--trainer.max_epochs", "2", *common, report_dir=tmp_path / "part", env=s3_endpoint.env
        )
    )
    resumed = launch_probe(
        strategy,
        part,
        "--trainer.max_epochs",
        "4",
        *common,
        ckpt="last",
        report_dir=tmp_path / "part",
        env=s3_endpoint.env,
    )
    assert_ok(resumed)
    assert f"resumed from s3://{bucket}/part/checkpoints/epoch=0002" in resumed.stderr

    # checkpoints committed in S3, last pointer at the end; the run resumed from is protected
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/part/checkpoints"))
    steps = 8 // STRATEGY_PROCS[strategy]
    assert names == [f"epoch={e:04d}-step={e * steps:07d}" for e in (2, 3, 4)] + ["last.json"]
    assert all(fs.exists(f"{bucket}/part/checkpoints/{n}/COMMITTED.json") for n in names[:-1])
    if strategy == "fsdp":
        shards = fs.ls(f"{bucket}/part/checkpoints/{names[-2]}/shards", detail=False)
        assert sorted(p.rsplit("/", 1)[-1] for p in shards) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # the resumed loss curve is the uninterrupted one
    a, b = _s3_lines(fs, f"{full}/metrics.jsonl"), _s3_lines(fs, f"{part}/metrics.jsonl")
    assert [line["epoch"] for line in b] == [1, 2, 3, 4]
    assert [line["train/loss"] for line in b] == pytest.approx([line["train/loss"] for line in a], rel=1e-9)
    assert (
        json.loads((tmp_path / "full" / "report_0.json").read_text())["weights_sha256"]
        == json.loads((tmp_path / "part" / "report_0.json").read_text())["weights_sha256"]
    )

    # the synced event files hold every epoch scalar with the right steps (TensorBoard's reader)
    scalars = _tb_scalars(fs, f"{full}/tensorboard", tmp_path / "tb")
    assert [step for step, _ in scalars["train/loss"]] == [line["step"] for line in a]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([line["train/loss"] for line in a], rel=1e-6)
    assert [step for step, _ in scalars["epoch"]] == [line["step"] for line in a]
    assert "lr_step" in scalars and "val/loss" in scalars


@pytest.mark.launch
def test_s3_outage_does_not_stop_training_and_logs_catch_up(s3_endpoint, bucket, tmp_path):
    """Deterministic: the run holds at two epoch ends (tests/probe/gates.py) while the test acts.

    After epoch 1 it waits until S3 is down, so epoch 2's event data can only be synced into the
    outage; after epoch 3 it waits until the outage has been reported and S3 is back. No step of
    the test depends on how long epochs or s3fs's retries take.
    """
    fs = s3_endpoint.fs()
    tb_url = f"s3://{bucket}/outage/tb"
    gates = tmp_path / "gates"
    proc = start_unifit(
        *probe_args(
            "single",
            tmp_path / "run",
            "--trainer.max_epochs",
            "30",
            "--trainer.tensorboard.sync_to",
            tb_url,
            "--trainer.tensorboard.sync_every_s",
            "0.3",
            # botocore without its own retries (a user setting too; s3fs still retries), so a sync pass gives up soon
            "--trainer.storage_options",
            json.dumps({"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}),
            callbacks=[
                {
                    "class_path": "tests.probe.gates.Gates",
                    "init_args": {"directory": str(gates), "epochs": [1, 3], "timeout_s": 150},
                }
            ],
        ),
        env=s3_endpoint.env,
    )
    err, out = _LineReader(proc.stderr), _LineReader(proc.stdout)
    s3_down = False
    try:
        _wait_for(
            lambda: os.path.exists(held(gates, 1)) and _exists(fs, f"{bucket}/outage/tb"),
            proc,
            err,
            "the run never reached epoch 1's end with its logs synced",
        )
        s3_endpoint.stop()  # S3 goes away mid-run ...
        s3_down = True
        open_gate(gates, 1)  # ... before epoch 2's scalars are written, so there is always something to sync
        _wait_for(lambda: any("failing" in line for line in err.lines), proc, err, "the outage was never reported")
        _wait_for(lambda: os.path.exists(held(gates, 3)), proc, err, "training stopped when S3 went away")
        assert proc.poll() is None, "training stopped when S3 went away"
        s3_endpoint.start()  # ... and comes back
        s3_down = False
        open_gate(gates, 3)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("training did not finish after S3 came back:\n" + err.text()) from None
        err.join(), out.join()  # the reader threads have taken the last lines
    finally:
        _kill_group(proc)
        if s3_down:  # the session's endpoint serves the tests after this one
            s3_endpoint.start()
    stderr = err.text()
    assert proc.returncode == 0, stderr
    assert stderr.count("failing") == 1, stderr  # reported once, not once per retry
    assert "recovered" in stderr
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scalars = _tb_scalars(fs, tb_url, tmp_path / "tb")
    assert [step for step, _ in scalars["train/loss"]] == [line["step"] for line in lines]
    assert len(lines) == 30


def _kill_group(proc: subprocess.Popen) -> None:
    """End every process a start_unifit() command started (its own session), if any is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _wait_for(condition, proc: subprocess.Popen, err: _LineReader, what: str, timeout: float = 90) -> None:
    """Poll `condition` until it holds; fail at once if the run ended, or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"{what} (the run ended with exit {proc.returncode}):\n{err.text()}"
        assert time.monotonic() < deadline, f"{what} within {timeout:g}s:\n{err.text()}"
        time.sleep(0.1)


class _LineReader:
    """A live copy of a process's output, read by a thread (`lines` fills as lines arrive)."""

    def __init__(self, stream) -> None:
        import threading

        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.lines.append(line)

    def join(self, timeout: float = 30) -> None:
        """After the process ended: wait until its output is read to the end."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the process's output never ended (a child still holds it open?)"

    def text(self) -> str:
        return "".join(self.lines)


def _exists(fs, path: str) -> bool:
    fs.invalidate_cache()
    try:
        return bool(fs.find(path))
    except Exception:
        return False


@pytest.mark.launch
def test_process_killed_during_s3_checkpoint_upload_leaves_no_committed_checkpoint(s3_endpoint, bucket):
    url = f"s3://{bucket}/killed"
    script = textwrap.dedent(f"""
        import time
        from unifit.checkpoint.store import CheckpointStore
        store = CheckpointStore({url!r})
        store.save("epoch=0001-step=0000010", lambda fs, d: fs.pipe_file(d + "/state.pt", b"good"), {{}})
        def slow(fs, d):
            fs.pipe_file(d + "/state.pt", b"partial payload")
            print("uploading", flush=True)
            time.sleep(60)
        store.save("epoch=0002-step=0000020", slow, {{}})
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **s3_endpoint.env},
    )
    try:
        assert proc.stdout.readline().strip() == "uploading"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    from unifit.checkpoint.store import CheckpointStore

    store = CheckpointStore(url)
    assert store.fs.exists(f"{bucket}/killed/epoch=0002-step=0000020/state.pt")  # the payload got there ...
    assert store.committed() == ["epoch=0001-step=0000010"]  # ... but it was never committed
    fs, path = store.resolve("last")
    assert fs.cat_file(f"{path}/state.pt") == b"good"


@pytest.mark.launch
@pytest.mark.parametrize("ckpt", [None, "auto"])  # auto must not read an unlistable location as "no checkpoint yet"
def test_missing_bucket_is_found_before_training(s3_endpoint, tmp_path, ckpt):
    result = launch_probe(
        "single",
        tmp_path / "run",
        "--trainer.checkpoint.dir",
        "s3://no-such-bucket-x/ckpt",
        env=s3_endpoint.env,
        timeout=120,
        ckpt=ckpt,
    )
    assert result.returncode == 2, result.stderr
    assert (
        "trainer.checkpoint.dir: 's3://no-such-bucket-x/ckpt' cannot be written: the bucket does not exist"
        in result.stderr
    )
    assert "epoch 1" not in result.stdout


@pytest.mark.launch
def test_bad_credentials_are_found_before_training_and_never_printed(tmp_path):
    """A second S3 server that checks credentials (moto's auth mode)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port)
        secret = "very-secret-value-123"
        options = json.dumps({"endpoint_url": f"http://127.0.0.1:{port}", "key": "AKIAWRONG", "secret": secret})
        result = launch_probe(
            "single",
            tmp_path / "run",
            "--trainer.checkpoint.dir",
            "s3://some-bucket/ckpt",
            "--trainer.storage_options",
            options,
            timeout=120,
        )
    finally:
        server.kill()
        server.wait()
    assert result.returncode == 2, result.stderr
    assert "'s3://some-bucket/ckpt' cannot be written: access denied" in result.stderr
    assert "check the credentials" in result.stderr
    assert secret not in result.stderr + result.stdout


@pytest.mark.launch
def test_secrets_never_reach_the_saved_config(s3_endpoint, bucket, tmp_path):
    options = json.dumps(
        {
            "endpoint_url": s3_endpoint.url,
            "key": s3_endpoint.env["AWS_ACCESS_KEY_ID"],
            "secret": s3_endpoint.env["AWS_SECRET_ACCESS_KEY"],
        }
    )
    result = launch_probe(
        "single",
        f"s3://{bucket}/secret-run",
        "--trainer.max_epochs",
        "1",
        "--trainer.storage_options",
        options,
        report_dir=tmp_path,
    )
    assert_ok(result)
    saved = s3_endpoint.fs().cat_file(f"{bucket}/secret-run/config.yaml").decode()
    assert "unifit-test-secret" not in saved and "secret: '***'" in saved
    assert s3_endpoint.url in saved  # the endpoint is not a secret


def _wait_for_port(port: int, timeout: float = 30) -> None:
    import socket

    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port}")


@pytest.mark.launch
def test_data_sharded_by_file_from_s3(s3_endpoint, bucket, tmp_path):
    from examples.digits.make_shards import write_shards

    write_shards(f"s3://{bucket}/digits", shards=4)
    result = run_unifit(
        "launch",
        "--nproc-per-node",
        "2",
        "-c",
        "examples/digits/sharded.yaml",
        "--data.init_args.train",
        f"s3://{bucket}/digits/train-*.npz",
        "--data.init_args.val",
        f"s3://{bucket}/digits/val-*.npz",
        "--trainer.root_dir",
        f"s3://{bucket}/runs/sharded",
        "--trainer.max_epochs",
        "6",
        env=s3_endpoint.env,
        timeout=200,
    )
    assert_ok(result)
    fs = s3_endpoint.fs()
    lines = _s3_lines(fs, f"s3://{bucket}/runs/sharded/metrics.jsonl")
    assert lines[-1]["val/acc"] >= 0.9
    # 1437 training samples in 4 files; each rank reads 2 files (~718 samples = 23 batches of 32)
    assert lines[-1]["step"] == 6 * 23
    assert fs.exists(f"{bucket}/runs/sharded/tensorboard") and fs.exists(f"{bucket}/runs/sharded/checkpoints/last.json")


def test_a_checkpoint_on_s3_is_named_by_its_url(s3_endpoint, bucket, tmp_path):
    """What a fit reports as its last checkpoint (loggers' log_checkpoint, Ray's report, messages) is a URL with
    its scheme on S3, and a plain path on a local disk: fsspec's own form drops the scheme."""
    from unifit.checkpoint.store import CheckpointStore

    assert CheckpointStore(f"s3://{bucket}/ckpt").location("epoch=0001-step=0000004") == (
        f"s3://{bucket}/ckpt/epoch=0001-step=0000004"
    )
    assert CheckpointStore(str(tmp_path / "ckpt")).location("last") == str(tmp_path / "ckpt" / "last")


def test_file_shards_split_by_rank_and_refuse_too_few_files(s3_endpoint, bucket):
    from unifit.data import NpzShards
    from unifit.errors import ConfigError

    fs = s3_endpoint.fs()
    import io

    import numpy as np

    for i in range(3):
        buffer = io.BytesIO()
        np.savez(buffer, x=np.full((i + 1, 2), i), y=np.full(i + 1, i))
        fs.pipe_file(f"{bucket}/few/part-{i}.npz", buffer.getvalue())
    shards = NpzShards(f"s3://{bucket}/few/part-*.npz")
    x0, y0 = shards.for_rank(0, 2)
    x1, y1 = shards.for_rank(1, 2)
    assert sorted(set(y0.tolist())) == [0, 2] and set(y1.tolist()) == {1}  # files 0,2 and file 1
    with pytest.raises(ConfigError, match="3 files .* cannot be split over 4 ranks"):
        shards.for_rank(0, 4)


@pytest.mark.launch
def test_unifit_tensorboard_serves_scalars_from_s3(s3_endpoint, bucket, tmp_path):
    """TensorBoard's own HTTP API answers with the scalars a run synced to S3."""
    import urllib.parse
    import urllib.request

    run = f"s3://{bucket}/viewed"
    assert_ok(launch_probe("single", run, "--trainer.max_epochs", "3", report_dir=tmp_path, env=s3_endpoint.env))
    lines = _s3_lines(s3_endpoint.fs(), f"{run}/metrics.jsonl")
    # port 0: TensorBoard binds a free port itself and the command prints its address (no port
    # picked here and bound there later, which another process could take in between)
    board = start_unifit("tensorboard", f"{run}/tensorboard", "--port", "0", "--refresh-s", "1", env=s3_endpoint.env)
    out, err = _LineReader(board.stdout), _LineReader(board.stderr)
    try:
        _wait_for(
            lambda: any("TensorBoard at http" in line for line in out.lines),
            board,
            err,
            "unifit tensorboard never said where it serves",
        )
        address = next(line for line in out.lines if "TensorBoard at http" in line).split(" at ", 1)[1].split()[0]
        base = address.rstrip("/") + "/data"
        runs: list = []

        def listed() -> bool:
            nonlocal runs
            try:
                runs = json.loads(urllib.request.urlopen(f"{base}/runs", timeout=5).read())
            except OSError:
                pass
            return bool(runs)

        _wait_for(listed, board, err, "TensorBoard listed no runs")
        query = urllib.parse.urlencode({"run": runs[0], "tag": "train/loss"})
        points: list = []

        def all_points() -> bool:
            nonlocal points
            points = json.loads(urllib.request.urlopen(f"{base}/plugin/scalars/scalars?{query}", timeout=5).read())
            return len(points) >= 3

        _wait_for(all_points, board, err, "TensorBoard never served the 3 epochs' train/loss", timeout=60)
    finally:
        board.terminate()
        try:
            board.wait(timeout=30)
        finally:
            _kill_group(board)
    assert [p[1] for p in points] == [line["step"] for line in lines]
    assert [p[2] for p in points] == pytest.approx([line["train/loss"] for line in lines], rel=1e-6)
