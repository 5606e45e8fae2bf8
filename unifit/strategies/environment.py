"""Where this process sits in the job, read from the launcher's environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class ClusterEnvironment:
    """Rank facts of one process; world_size 1 when no launcher set anything."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "none"

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    from unifit.errors import DistributedError

    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"environment variable {name}={raw!r} is not an integer; fix the launcher settings") from None


def from_torchrun(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """torchrun / torch.distributed.run: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = _int(env, "WORLD_SIZE", 1)
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    return ClusterEnvironment(
        rank=_int(env, "RANK", 0),
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", 0),
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", _int(env, "RANK", 0) // max(1, local_world)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", 29500),
        source="torchrun",
    )


def from_horovodrun(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """horovodrun --gloo: HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK/SIZE, HOROVOD_CROSS_RANK."""
    env = os.environ if env is None else env
    if "HOROVOD_RANK" not in env or "HOROVOD_SIZE" not in env:
        return None
    world = _int(env, "HOROVOD_SIZE", 1)
    return ClusterEnvironment(
        rank=_int(env, "HOROVOD_RANK", 0), world_size=world, local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
        local_world_size=_int(env, "HOROVOD_LOCAL_SIZE", world), node_rank=_int(env, "HOROVOD_CROSS_RANK", 0),
        master_addr=env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1"),
        master_port=_int(env, "HOROVOD_GLOO_RENDEZVOUS_PORT", 29500), source="horovodrun")


def from_open_mpi(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """mpirun (Open MPI), as SageMaker's mpi and smdistributed launchers start processes.

    The rendezvous for torch.distributed is MASTER_ADDR/MASTER_PORT when set, else the first
    SageMaker host (SM_HOSTS) or 127.0.0.1, on port 29500.
    """
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_RANK" not in env or "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    world = _int(env, "OMPI_COMM_WORLD_SIZE", 1)
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
    rank = _int(env, "OMPI_COMM_WORLD_RANK", 0)
    master = env.get("MASTER_ADDR")
    if not master and env.get("SM_HOSTS"):
        master = parse_hosts(env["SM_HOSTS"])[0]
    return ClusterEnvironment(
        rank=rank, world_size=world, local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        local_world_size=local_world, node_rank=_int(env, "OMPI_COMM_WORLD_NODE_RANK", rank // max(1, local_world)),
        master_addr=master or "127.0.0.1", master_port=_int(env, "MASTER_PORT", 29500), source="open-mpi")


def from_tf_config(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """TF_CONFIG (MultiWorkerMirroredStrategy): rank = this task's place, chief first, then workers."""
    import json

    from unifit.errors import ConfigError

    env = os.environ if env is None else env
    raw = env.get("TF_CONFIG")
    if not raw:
        return None
    try:
        config = json.loads(raw)
        cluster, task = config["cluster"], config["task"]
        tasks = [("chief", i) for i in range(len(cluster.get("chief", [])))] + \
                [("worker", i) for i in range(len(cluster.get("worker", [])))]
        rank = tasks.index((task["type"], int(task["index"])))
        addresses = [cluster[kind][i] for kind, i in tasks]
        host, _, port = addresses[0].rpartition(":")
        int(port)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(
            f"TF_CONFIG: received {raw!r}; expected {{\"cluster\": {{\"worker\": [\"host:port\", ...]}}, "
            "\"task\": {\"type\": \"worker\", \"index\": N}} with this task listed in the cluster") from None
    return ClusterEnvironment(rank=rank, world_size=len(tasks), local_rank=0, local_world_size=1, node_rank=rank,
                              master_addr=host, master_port=int(port), source="tf_config")


# Readers tried in order; the first that recognises its launcher's variables wins.
READERS = (from_torchrun, from_horovodrun, from_open_mpi, from_tf_config)


def detect(env: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """The first reader that recognises the environment, else a world of one."""
    for reader in READERS:
        found = reader(env)
        if found is not None:
            return found
    return ClusterEnvironment()


def parse_hosts(raw: str) -> list[str]:
    """SageMaker's SM_HOSTS (a JSON list of host names)."""
    import json

    from unifit.errors import ConfigError

    try:
        hosts = json.loads(raw)
    except json.JSONDecodeError:
        hosts = None
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) and h for h in hosts):
        raise ConfigError(f"SM_HOSTS: received {raw!r}; expected a JSON list of host names like [\"algo-1\", \"algo-2\"]")
    return hosts
