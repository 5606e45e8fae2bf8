"""Where this process sits in the job, read from the launcher's environment variables."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

_R = TypeVar("_R")


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
        raise DistributedError(
            f"environment variable {name}={raw!r} is not an integer; fix the launcher settings"
        ) from None


# what torchrun (torch.distributed.run) sets on every rank besides RANK/WORLD_SIZE; a process with
# RANK/WORLD_SIZE and none of these was started one per machine (a PyTorchJob pod, or by hand)
TORCHRUN_MARKERS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def config_int(env: Mapping[str, str], name: str, default: int) -> int:
    """An integer variable; anything else is a ConfigError naming it (a cluster's settings, fixed by the user)."""
    from unifit.errors import ConfigError

    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; fix the job's settings") from None


def from_torchrun(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """torchrun / torch.distributed.run: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env or not any(name in env for name in TORCHRUN_MARKERS):
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


RAY_TRAIN_MARKER = "UNIFIT_RAY_TRAIN"  # set by unifit.ray in each Ray Train worker before the fit starts


def from_ray_train(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """A Ray Train worker running unifit.ray's loop: Ray started the process, set RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR/PORT and made the process group itself (it is used, not made again).
    Its variables look like torchrun's, so the marker unifit.ray sets tells them apart."""
    env = os.environ if env is None else env
    found = from_torchrun(env) if RAY_TRAIN_MARKER in env else None
    if found is None:
        return None
    return dataclasses.replace(found, node_rank=_int(env, "NODE_RANK", found.node_rank), source="ray")


def from_horovodrun(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """horovodrun --gloo: HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK/SIZE, HOROVOD_CROSS_RANK."""
    env = os.environ if env is None else env
    if "HOROVOD_RANK" not in env or "HOROVOD_SIZE" not in env:
        return None
    world = _int(env, "HOROVOD_SIZE", 1)
    return ClusterEnvironment(
        rank=_int(env, "HOROVOD_RANK", 0),
        world_size=world,
        local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
        local_world_size=_int(env, "HOROVOD_LOCAL_SIZE", world),
        node_rank=_int(env, "HOROVOD_CROSS_RANK", 0),
        master_addr=env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1"),
        master_port=_int(env, "HOROVOD_GLOO_RENDEZVOUS_PORT", 29500),
        source="horovodrun",
    )


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
        rank=rank,
        world_size=world,
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        local_world_size=local_world,
        node_rank=_int(env, "OMPI_COMM_WORLD_NODE_RANK", rank // max(1, local_world)),
        master_addr=master or "127.0.0.1",
        master_port=_int(env, "MASTER_PORT", 29500),
        source="open-mpi",
    )


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
        kind = str(task["type"]).lower()  # TFJob writes its replica types in lower case
        if cluster.get("ps"):  # a parameter-server cluster: the chief alone runs unifit's loop
            return _parameter_server_chief(kind, raw)
        if kind not in ("chief", "worker"):
            raise ConfigError(
                f"TF_CONFIG: task type {task['type']!r}: unifit trains with MultiWorkerMirroredStrategy, which "
                "runs 'chief' and 'worker' tasks only; give the job (TFJob) Chief and Worker replicas, "
                "no PS, Evaluator or Master"
            )
        tasks = [("chief", i) for i in range(len(cluster.get("chief") or []))] + [
            ("worker", i) for i in range(len(cluster.get("worker") or []))
        ]
        rank = tasks.index((kind, int(task["index"])))
        addresses = [cluster[task_type][i] for task_type, i in tasks]
        host, _, port = addresses[0].rpartition(":")
        int(port)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(
            f'TF_CONFIG: received {raw!r}; expected {{"cluster": {{"worker": ["host:port", ...]}}, '
            '"task": {"type": "worker", "index": N}} with this task listed in the cluster'
        ) from None
    return ClusterEnvironment(
        rank=rank,
        world_size=len(tasks),
        local_rank=0,
        local_world_size=1,
        node_rank=rank,
        master_addr=host,
        master_port=int(port),
        source="tf_config",
    )


def _parameter_server_chief(kind: str, raw: str) -> ClusterEnvironment:
    from unifit.errors import ConfigError

    if kind not in ("chief", "master"):
        raise ConfigError(
            f"TF_CONFIG: task type {kind!r} of a parameter-server cluster: its 'ps' and 'worker' tasks are servers "
            "(python -m unifit.strategies.tf_server), the 'chief' runs unifit fit with trainer.strategy "
            f"parameter-server; received {raw!r}"
        )
    return ClusterEnvironment(source="tf_config_ps")


def from_slurm(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """A task that `srun` started: SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS, SLURM_LOCALID,
    SLURM_NODEID, tasks per node.

    Taken only inside a job step (SLURM_STEP_ID set: srun started this process); the batch script
    itself (SLURM_PROCID=0 of the whole job, no step) or an `salloc` shell is a world of one. The
    rendezvous is MASTER_ADDR when set, else the first host of the step's (or job's) node list;
    MASTER_PORT when set, else a port derived from SLURM_JOB_ID and the step, the same on every task.
    """
    env = os.environ if env is None else env
    if "SLURM_PROCID" not in env or not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
        return None
    if not (env.get("SLURM_NTASKS") or env.get("SLURM_STEP_NUM_TASKS")):
        return None
    # the step's own count first: `srun --preserve-env` leaves SLURM_NTASKS at the allocation's
    world_var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    world = config_int(env, world_var, 1)
    rank = config_int(env, "SLURM_PROCID", 0)
    node = config_int(env, "SLURM_NODEID", 0)
    local_world = _slurm_local_world(env, node, world)
    local_rank = config_int(env, "SLURM_LOCALID", rank % max(1, local_world))
    if world < 1 or not 0 <= rank < world or not 0 <= local_rank < local_world or node < 0:
        from unifit.errors import ConfigError

        raise ConfigError(
            f"SLURM: SLURM_PROCID={rank}, SLURM_LOCALID={local_rank}, SLURM_NODEID={node} do not fit "
            f"{world_var}={world} with {local_world} task(s) on this node; start the ranks with srun"
        )
    master = env.get("MASTER_ADDR")
    if not master:
        name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)), None)
        master = first_host(env[name], name) if name else "127.0.0.1"
    port = config_int(env, "MASTER_PORT", 0) or slurm_port(
        env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID", "")
    )
    return ClusterEnvironment(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node,
        master_addr=master,
        master_port=port,
        source="slurm",
    )


def from_env_rank(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """One process per machine with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and no torchrun around it:
    a Kubeflow PyTorchJob pod (the operator sets them; RANK is the pod's index, master 0 then the
    workers) or variables exported by hand. local_rank 0, one process per node, node_rank = RANK.

    When the operator was asked for several processes per pod (PET_NPROC_PER_NODE > 1), WORLD_SIZE counts
    them all and RANK is the pod's index: those processes must be started by `unifit launch` (torchrun).
    """
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    from unifit.errors import ConfigError

    world = config_int(env, "WORLD_SIZE", 1)
    rank = config_int(env, "RANK", 0)
    per_pod = env.get("PET_NPROC_PER_NODE", "")
    if per_pod.isdigit() and int(per_pod) > 1:
        raise ConfigError(
            f"PET_NPROC_PER_NODE={per_pod}: this pod must run {per_pod} processes; start them with "
            f"unifit launch --nproc-per-node {per_pod} --nnodes $PET_NNODES --node-rank $PET_NODE_RANK "
            "--master-addr $MASTER_ADDR --master-port $MASTER_PORT -c <experiment.yaml>"
        )
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={world}; fix the job's environment variables")
    kubernetes = any(n in env for n in ("KUBERNETES_SERVICE_HOST", "PET_NNODES", "PET_NODE_RANK"))
    return _one_process_per_node(env, rank, world, "", "pytorchjob" if kubernetes else "env")


def _one_process_per_node(
    env: Mapping[str, str], rank: int, world: int, prefix: str, source: str
) -> ClusterEnvironment:
    """Rank `rank` of `world` pods or machines, one process each, meeting at {prefix}MASTER_ADDR:{prefix}MASTER_PORT."""
    return ClusterEnvironment(
        rank=rank,
        world_size=world,
        local_rank=0,
        local_world_size=1,
        node_rank=rank,
        master_addr=env.get(f"{prefix}MASTER_ADDR") or "127.0.0.1",
        master_port=config_int(env, f"{prefix}MASTER_PORT", 29500),
        source=source,
    )


def trainjob_processes_per_pod(env: Mapping[str, str]) -> int:
    """PET_NPROC_PER_NODE as a number: Kubeflow Trainer resolves `auto` itself for most runtimes; one left as
    `auto` (or `gpu`) is one process per visible GPU, or one on a CPU pod (torchrun's `auto` would start one
    per CPU core, which no one trains with)."""
    raw = env.get("PET_NPROC_PER_NODE", "").strip()
    if raw in ("", "auto", "gpu"):
        from unifit.strategies.torch_device import gpus_visible

        return max(1, gpus_visible()) if raw else 1
    value = config_int(env, "PET_NPROC_PER_NODE", 1)
    if value < 1:
        from unifit.errors import ConfigError

        raise ConfigError(f"environment variable PET_NPROC_PER_NODE={raw!r}: give 1 or more processes per pod")
    return value


def from_kubeflow_trainer(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """A Kubeflow Trainer v2 TrainJob pod whose command is `unifit fit` itself (its torch runtime's command is
    normally torchrun, which reads these): PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT,
    PET_NPROC_PER_NODE and no RANK or WORLD_SIZE. One process per pod: the pod's node rank is the rank, the
    pods are the world. A pod asked for several processes needs them started: `unifit launch` reads PET_*."""
    env = os.environ if env is None else env
    if "PET_NNODES" not in env or "RANK" in env or "WORLD_SIZE" in env:
        return None
    from unifit.errors import ConfigError

    nodes = config_int(env, "PET_NNODES", 1)
    node = config_int(env, "PET_NODE_RANK", 0)
    per_pod = trainjob_processes_per_pod(env)
    if per_pod > 1:
        raise ConfigError(
            f"PET_NPROC_PER_NODE={env.get('PET_NPROC_PER_NODE')}: this TrainJob pod must run {per_pod} processes, "
            "and `unifit fit` is one; make the container's command `unifit launch -c <experiment.yaml>` (it reads "
            "PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT and PET_NPROC_PER_NODE and starts them)"
        )
    if nodes < 1 or not 0 <= node < nodes:
        raise ConfigError(f"PET_NODE_RANK={node} is not below PET_NNODES={nodes}; fix the TrainJob's environment")
    return _one_process_per_node(env, node, nodes, "PET_", "trainjob")


# Readers tried in order; the first that recognises its launcher's variables wins (Ray Train's workers first: their
# variables are torchrun's plus unifit.ray's marker). A launcher started
# inside another's allocation sets its own variables on the processes it starts, so the innermost
# launcher comes first: torchrun, horovodrun, mpirun and the TF_CONFIG workers (`unifit launch` in an
# srun task or a PyTorchJob pod) before SLURM, whose variables every process of the allocation inherits,
# and before the bare RANK/WORLD_SIZE of a PyTorchJob pod; a TrainJob pod sets PET_* alone.
READERS = (
    from_ray_train,
    from_torchrun,
    from_horovodrun,
    from_open_mpi,
    from_tf_config,
    from_slurm,
    from_kubeflow_trainer,
    from_env_rank,
)


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
        raise ConfigError(f'SM_HOSTS: received {raw!r}; expected a JSON list of host names like ["algo-1", "algo-2"]')
    return hosts


def parse_tasks_per_node(raw: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """SLURM's compressed tasks-per-node list: '2(x3),1' -> [2, 2, 2, 1]."""
    import re

    from unifit.errors import ConfigError

    counts: list[int] = []
    for item in raw.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise ConfigError(f"environment variable {name}={raw!r} is not a tasks-per-node list like '2(x3),1'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _slurm_local_world(env: Mapping[str, str], node: int, world: int) -> int:
    """Tasks on this node: the step's layout, else the job's, else --ntasks-per-node."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = parse_tasks_per_node(env[name], name)
            return counts[node] if node < len(counts) else counts[-1]
    return config_int(env, "SLURM_NTASKS_PER_NODE", world)


def expand_nodelist(raw: str, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """SLURM's compressed host list, as `scontrol show hostnames` prints it:
    'node[01-03,07],gpu5' -> node01 node02 node03 node07 gpu5; 'r[1-2]-n[1-2]' -> r1-n1 r1-n2 r2-n1 r2-n2.
    Zero padding is kept ('[08-10]' -> 08 09 10)."""
    import itertools
    import re

    from unifit.errors import ConfigError

    def bad() -> ConfigError:
        return ConfigError(f"environment variable {name}={raw!r} is not a SLURM node list like 'node[01-03,07],gpu5'")

    hosts: list[str] = []
    for expr in _split_top_level(raw, bad):
        parts: list[list[str]] = []
        for token in re.finditer(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", expr):
            literal, ranges = token.group(1), token.group(2)
            if literal:
                parts.append([literal])
            if ranges is not None:
                choices: list[str] = []
                for piece in ranges.split(","):
                    match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
                    if not match:
                        raise bad()
                    low, high = match.group(1), match.group(2) or match.group(1)
                    if int(high) < int(low):
                        raise bad()
                    choices += [str(i).zfill(len(low)) for i in range(int(low), int(high) + 1)]
                parts.append(choices)
        if not parts or expr.count("[") != expr.count("]"):
            raise bad()
        hosts += ["".join(combo) for combo in itertools.product(*parts)]
    if not hosts:
        raise bad()
    return hosts


def _split_top_level(raw: str, bad) -> list[str]:
    """'a[1,2],b' -> ['a[1,2]', 'b']: commas outside brackets separate host expressions."""
    exprs, depth, current = [], 0, ""
    for char in raw.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise bad()
        if char == "," and depth == 0:
            exprs.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise bad()
    exprs.append(current)
    if any(not e.strip() for e in exprs):
        raise bad()
    return [e.strip() for e in exprs]


def first_host(raw: str, name: str = "SLURM_JOB_NODELIST") -> str:
    """The first host of a SLURM node list: `scontrol show hostnames` where it runs, else unifit's own parser."""
    import shutil
    import subprocess

    if "[" in raw and shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", raw], capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_nodelist(raw, name)[0]


def slurm_port(job_id: str, step_id: str = "") -> int:
    """A rendezvous port in 10000-29999 from the job and step ids: the same on every task of a step,
    different for most concurrent jobs (set MASTER_PORT to choose one yourself)."""
    import zlib

    if not job_id:
        return 29500
    return 10000 + zlib.crc32(f"{job_id}.{step_id}".encode()) % 20000


def rank_zero_only(fn: Callable[..., _R]) -> Callable[..., _R | None]:
    """`fn` runs on the job's global rank 0 only; the other ranks get None (Lightning's rank_zero_only). For a
    script's own work after fit, which every launched rank runs: saving a model, reading metrics.csv, printing."""

    @functools.wraps(fn)
    def on_rank_zero(*args: Any, **kwargs: Any) -> _R | None:
        return fn(*args, **kwargs) if detect().rank == 0 else None

    return on_rank_zero
