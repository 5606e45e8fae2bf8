"""smddp-like: hierarchical allreduce equals flat DDP; topology errors are clear."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import REPO
from unifit.errors import ConfigError
from unifit.strategies.smddp import Topology


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.launch
@pytest.mark.timeout(180)
def test_hierarchical_gradients_equal_flat_ddp_on_2_nodes_x_2_ranks(tmp_path):
    """Two torchrun 'nodes' on this machine (static rendezvous), 2 ranks each."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HIERARCHY_OUT": str(tmp_path)}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "tests/probe/hierarchy_check.py",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    try:
        for proc in nodes:
            _, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, err
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    outputs = [json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")]
    assert sorted(o["rank"] for o in outputs) == [0, 1, 2, 3]
    assert all(o["nodes"] == 2 for o in outputs)
    assert max(o["max_abs_diff"] for o in outputs) <= 1e-6, outputs


def test_topology_facts():
    topo = Topology(world_size=8, local_size=4, rank=6)
    assert (topo.nodes, topo.node, topo.leader, topo.is_leader) == (2, 1, 4, False)
    assert topo.leaders == [0, 4] and topo.node_ranks(1) == [4, 5, 6, 7]


def test_inconsistent_topology_is_a_clear_error():
    with pytest.raises(ConfigError, match="world size 6 is not a multiple of the ranks per node \\(4\\)"):
        Topology(world_size=6, local_size=4, rank=0)


@pytest.mark.launch
@pytest.mark.timeout(180)
def test_strategy_reports_its_allreduce(tmp_path):
    from tests.helpers import assert_ok, launch_probe

    hierarchical = launch_probe("smddp-like", tmp_path / "h", "--trainer.max_epochs", "1")
    assert_ok(hierarchical)
    assert "smddp-like: hierarchical allreduce, 2 node(s) x 2 rank(s)" in hierarchical.stderr
    one_node = launch_probe("ddp", tmp_path / "f", "--trainer.strategy", "smddp-like", "--trainer.max_epochs", "1")
    assert_ok(one_node)
    assert "flat allreduce (nothing to gain from a hierarchy), 1 node(s) x 2 rank(s)" in one_node.stderr


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_smddp_implementation_without_the_library_is_a_clear_error(tmp_path):
    from tests.helpers import launch_probe

    result = launch_probe(
        "ddp", tmp_path, "--trainer.strategy", "smddp-like", "--trainer.strategy_options", "{implementation: smddp}"
    )
    assert result.returncode == 2, result.stderr
    assert "'smddp' needs smdistributed.dataparallel" in result.stderr
