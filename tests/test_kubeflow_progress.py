"""A Kubeflow TrainJob's progress: where the Trainer's progress plugin set KUBEFLOW_TRAINER_STATUS_URL, _CA_CERT
and _TOKEN, `unifit fit` posts the fit's progress there by itself, as Hugging Face's Trainer does.

The server is a real HTTPS server on 127.0.0.1 with a self-signed certificate (made by openssl) and a token file,
as the plugin mounts them. The controller takes one status per 5 s; the tests shorten that interval to keep the fit
short, and check the spacing against it."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers import PROBE_YAML, metrics_lines
from unifit.callbacks import kubeflow_progress
from unifit.callbacks.kubeflow_progress import CA_CERT, STATUS_URL, TOKEN

INTERVAL_S = 0.4

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the server's certificate")


@pytest.fixture
def status_server(tmp_path):
    """(the pod's environment, the posts received: (time, headers, body))."""
    cert, key = tmp_path / "ca.crt", tmp_path / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    posts: list[tuple[float, dict, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posts.append((time.monotonic(), dict(self.headers), body))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    token = tmp_path / "token"
    token.write_text("service-account-token\n")
    url = f"https://127.0.0.1:{server.server_address[1]}/apis/trainer.kubeflow.org/v1alpha1/trainjobs/job/status"
    try:
        yield {STATUS_URL: url, CA_CERT: str(cert), TOKEN: str(token)}, posts
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _fit(cli, root, env):
    slow = [{"class_path": "tests.probe.callbacks.SlowSteps", "init_args": {"seconds": 0.1}}]
    args = ["fit", "-c", str(PROBE_YAML), "--trainer.root_dir", str(root), "--trainer.max_epochs", "2"]
    result = cli(*args, "--trainer.callbacks", json.dumps(slow), env=env)
    assert result.returncode == 0, result.stderr
    return result


def test_a_fit_posts_its_progress_at_most_once_per_interval_and_an_outage_changes_nothing(
    cli, tmp_path, status_server, monkeypatch
):
    monkeypatch.setattr(kubeflow_progress, "MIN_INTERVAL_S", INTERVAL_S)
    env, posts = status_server
    _fit(cli, tmp_path / "reported", env)
    assert len(posts) >= 4, posts
    for _, headers, _ in posts:
        assert headers["Authorization"] == "Bearer service-account-token"
        assert headers["Content-Type"] == "application/json"
    gaps = [b[0] - a[0] for a, b in zip(posts, posts[1:])]
    assert min(gaps) >= INTERVAL_S - 0.05, gaps
    statuses = [body["trainerStatus"] for _, _, body in posts]
    percents = [s["progressPercentage"] for s in statuses]
    assert percents == sorted(percents) and percents[-1] == 100 and 0 < percents[len(percents) // 2] < 100, percents
    for status in statuses:
        assert datetime.fromisoformat(status["lastUpdatedTime"]).tzinfo is not None
        assert all(set(m) == {"name", "value"} and isinstance(m["value"], str) for m in status["metrics"])
        assert status.get("estimatedRemainingSeconds", 0) >= 0
    assert any(s.get("estimatedRemainingSeconds", 0) > 0 for s in statuses[1:-1]), statuses  # from the pace so far
    assert percents.count(100) == 1, percents
    last = {m["name"]: m["value"] for m in statuses[-1]["metrics"]}
    assert last["epoch"] == "2" and statuses[-1]["estimatedRemainingSeconds"] == 0
    assert float(last["val/loss"]) == pytest.approx(metrics_lines(tmp_path / "reported")[-1]["val/loss"], rel=1e-5)

    with socket.socket() as s:  # the server is down: nothing listens there
        s.bind(("127.0.0.1", 0))
        down = {**env, STATUS_URL: f"https://127.0.0.1:{s.getsockname()[1]}/status"}
    result = _fit(cli, tmp_path / "outage", down)
    warnings = [line for line in result.stderr.splitlines() if "kubeflow progress: could not post" in line]
    assert len(warnings) == 1, result.stderr
    for ours, theirs in zip(metrics_lines(tmp_path / "outage"), metrics_lines(tmp_path / "reported"), strict=True):
        assert ours["train/loss"] == theirs["train/loss"] and ours["val/loss"] == theirs["val/loss"]
