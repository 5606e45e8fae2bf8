"""A parameter-server chief never waits forever for its cluster: SageMaker's entry point on one host (whose name,
algo-1, need not resolve) trains, and a task nobody can reach ends the chief within trainer.collective_timeout_s
in one line naming it (TensorFlow's own connect retries forever inside C++, deaf to SIGINT)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.helpers import REPO
from unifit.errors import DistributedError
from unifit.strategies.parameter_server import wait_for_cluster


def test_an_unreachable_task_ends_the_wait_in_one_line_naming_it():
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        up, down = (f"127.0.0.1:{s.getsockname()[1]}" for s in (listening, closed))
        wait_for_cluster({"ps": [up], "worker": [up]}, timeout_s=5)  # every task answers: no wait
        started = time.monotonic()
        with pytest.raises(DistributedError) as caught:
            wait_for_cluster({"ps": [up, "algo-9.invalid:2222"], "worker": [up, down]}, timeout_s=1.5)
    message = str(caught.value)
    assert time.monotonic() - started < 10
    assert (
        "\n" not in message
        and "waited 1.5 s for ps 1 at algo-9.invalid:2222 (algo-9.invalid does not resolve" in message
    )
    assert f"worker 1 at {down} (" in message and "ps 0" not in message and "collective_timeout_s" in message


@pytest.mark.launch
@pytest.mark.tf
@pytest.mark.timeout(400)
def test_sagemakers_entry_point_trains_parameter_server_on_one_host(tmp_path):
    """SM_HOSTS ["algo-1"], no distribution, 2 workers: the chief, 2 workers and a parameter server on this host
    (it hung, silent, for 600 s: the cluster was addressed by a name this machine cannot resolve)."""
    from tests.test_sagemaker import _finish, _toolkit

    hps = {"config": str(REPO / "examples" / "digits" / "parameter_server.yaml"), "nproc_per_node": 2}
    hps |= {"trainer.max_epochs": 1, "trainer.collective_timeout_s": 60}
    output = _finish([_toolkit(tmp_path / "job", ["algo-1"], "algo-1", hps)], timeout=300)[0]
    assert "parameter-server: 2 worker(s), 1 parameter server(s)" in output, output[-3000:]
    assert (tmp_path / "job" / "output" / "success").exists()
    metrics = tmp_path / "job" / "output" / "data" / "runs" / "digits-parameter-server" / "metrics.jsonl"
    assert json.loads(metrics.read_text().splitlines()[-1])["val/acc"] > 0.5
