"""Cluster environments: SLURM (srun), Kubeflow PyTorchJob and TFJob are detected like torchrun and SageMaker.

Unit tests of detect() with the variables each one sets, the precedence when one launcher runs inside
another's allocation, the SLURM list parsers, bad input; and real processes started with those variables
(as srun and the PyTorchJob operator would start them) that must form one world and train.
"""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from tests.helpers import KERAS_PROBE_YAML, PROBE_YAML, assert_ok, reports, run_together, run_unifit
from unifit.errors import ConfigError
from unifit.strategies import environment, registry
from unifit.strategies.environment import detect, expand_nodelist, parse_tasks_per_node, slurm_port


def srun_env(rank: int, ntasks: int = 2, per_node: int = 2, **extra: str) -> dict[str, str]:
    """What `srun --ntasks N` sets on task `rank` (block distribution, `per_node` tasks per node)."""
    nodes = -(-ntasks // per_node)
    return {
        "SLURM_JOB_ID": "4711",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(rank // per_node),
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_JOB_NODELIST": f"node[01-{nodes:02d}]",
        "SLURM_NNODES": str(nodes),
        **extra,
    }


def facts(env) -> tuple:
    return env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.source


# ---- SLURM -------------------------------------------------------------------------------------------


def test_srun_task_is_detected_with_the_first_node_as_master():
    env = detect(srun_env(5, ntasks=8, per_node=4))
    assert facts(env) == (5, 8, 1, 4, 1, "slurm")
    assert env.master_addr == "node01" and env.num_nodes == 2
    assert env.master_port == slurm_port("4711", "0") and 10000 <= env.master_port < 30000


def test_slurm_master_port_and_addr_from_the_environment_win():
    env = detect(srun_env(1, MASTER_ADDR="10.1.2.3", MASTER_PORT="12345"))
    assert (env.master_addr, env.master_port) == ("10.1.2.3", 12345)


def test_slurm_port_is_the_same_for_every_task_and_differs_between_jobs():
    ports = {detect(srun_env(r, ntasks=4, per_node=2)).master_port for r in range(4)}
    assert len(ports) == 1
    assert len({slurm_port(str(job)) for job in range(1000, 1050)}) > 40
    assert slurm_port("") == 29500


def test_slurm_uneven_tasks_per_node_and_step_values():
    # srun -n 5 on 2 nodes: 3 tasks on node 0, 2 on node 1; the step's layout wins over the job's
    env = {
        **srun_env(4, ntasks=5),
        "SLURM_NODEID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_TASKS_PER_NODE": "3,2",
        "SLURM_STEP_NODELIST": "gpu[7-8]",
        "SLURM_JOB_NODELIST": "gpu[1-8]",
    }
    found = detect(env)
    assert facts(found) == (4, 5, 1, 2, 1, "slurm") and found.master_addr == "gpu7"
    # srun --preserve-env leaves SLURM_NTASKS at the allocation's; the step's count wins
    assert (
        detect(
            {**srun_env(1, ntasks=8, per_node=4), "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2"}
        ).world_size
        == 2
    )
    # only --ntasks-per-node given
    plain = {k: v for k, v in srun_env(3, ntasks=4).items() if k != "SLURM_TASKS_PER_NODE"}
    assert detect({**plain, "SLURM_NTASKS_PER_NODE": "2"}).local_world_size == 2


def test_slurm_batch_script_and_salloc_shell_are_a_world_of_one():
    # the batch script has SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step: srun was not used
    batch = {k: v for k, v in srun_env(0, ntasks=4).items() if k != "SLURM_STEP_ID"}
    assert detect(batch).source == "none"
    assert detect({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"}).source == "none"


@pytest.mark.parametrize(
    "raw, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("gpu5,node[1-2]", ["gpu5", "node1", "node2"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("a-[1-2].cluster.org,b.cluster.org", ["a-1.cluster.org", "a-2.cluster.org", "b.cluster.org"]),
        ("10.0.0.5", ["10.0.0.5"]),
    ],
)
def test_nodelist_expansion(raw, hosts):
    assert expand_nodelist(raw) == hosts


@pytest.mark.parametrize("raw", ["node[01-03", "node]1[", "node[a-b]", "node[3-1]", "", "a,,b", "n[]"])
def test_bad_nodelist_is_a_config_error_naming_the_variable(raw):
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(raw)


def test_tasks_per_node_expansion():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node("2(3)")


def test_scontrol_is_used_when_available(monkeypatch, tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho fromscontrol\necho other\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path), prepend=":")
    assert detect(srun_env(1)).master_addr == "fromscontrol"


@pytest.mark.parametrize(
    "name, value",
    [
        ("SLURM_NTASKS", "two"),
        ("SLURM_PROCID", "x"),
        ("SLURM_LOCALID", "1.0"),
        ("SLURM_NODEID", "?"),
        ("MASTER_PORT", "http"),
        ("SLURM_TASKS_PER_NODE", "2(x)"),
        ("SLURM_JOB_NODELIST", "n[1-"),
    ],
)
def test_bad_slurm_variable_is_a_one_line_config_error_naming_it(name, value):
    with pytest.raises(ConfigError) as info:
        detect(srun_env(1, **{name: value}))
    assert name in str(info.value) and "\n" not in str(info.value)


def test_slurm_rank_outside_the_world_is_a_config_error():
    with pytest.raises(ConfigError, match="SLURM_PROCID=2"):
        detect(srun_env(0, SLURM_PROCID="2"))


# ---- precedence: a launcher inside a SLURM allocation or a PyTorchJob pod -------------------------------

TORCHRUN_CHILD = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "head",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "x",
}


def test_torchrun_inside_a_slurm_task_wins():
    # srun one task per node running `unifit launch --nproc-per-node 2`: the ranks inherit the task's SLURM_*
    env = detect({**srun_env(0, ntasks=2, per_node=1), **TORCHRUN_CHILD})
    assert facts(env) == (3, 4, 1, 2, 1, "torchrun") and env.master_addr == "head"


@pytest.mark.tf
def test_horovodrun_mpirun_and_tf_config_inside_a_slurm_allocation_win():
    slurm = srun_env(0, ntasks=1, per_node=1)
    hvd = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"}
    assert detect({**slurm, **hvd}).source == "horovodrun"
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert detect({**slurm, **ompi}).source == "open-mpi"
    tf = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 1}})}
    assert facts(detect({**slurm, **tf}))[:2] == (1, 2) and detect({**slurm, **tf}).source == "tf_config"


def test_slurm_wins_over_bare_rank_variables():
    # a script exporting RANK/WORLD_SIZE (without torchrun) under srun: the task's own SLURM facts count
    env = detect({**srun_env(1), "RANK": "1", "WORLD_SIZE": "2"})
    assert facts(env) == (1, 2, 1, 2, 0, "slurm")


# ---- Kubeflow PyTorchJob -------------------------------------------------------------------------------


def pytorchjob_env(pod_rank: int, replicas: int = 3, **extra: str) -> dict[str, str]:
    """What the training operator sets in pod `pod_rank` (Master is 0, Worker i is i + 1)."""
    return {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": str(replicas),
        "RANK": str(pod_rank),
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(pod_rank),
        "PET_NNODES": str(replicas),
        "PYTHONUNBUFFERED": "0",
        **extra,
    }


def test_pytorchjob_pod_is_one_process_per_node():
    env = detect(pytorchjob_env(2))
    assert facts(env) == (2, 3, 0, 1, 2, "pytorchjob")
    assert (env.master_addr, env.master_port, env.num_nodes) == ("job-master-0", 23456, 3)
    # older operators set no PET_* variables; nproc_per_node "auto" is one process as well
    old_operator = {k: v for k, v in pytorchjob_env(1).items() if not k.startswith("PET_")}
    assert facts(detect(old_operator))[:5] == (1, 3, 0, 1, 1)
    assert detect(pytorchjob_env(1, PET_NPROC_PER_NODE="auto")).local_world_size == 1


def test_bare_rank_variables_without_kubernetes():
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert facts(env) == (1, 2, 0, 1, 1, "env") and (env.master_addr, env.master_port) == ("10.0.0.1", 1234)


def test_torchrun_inside_a_pytorchjob_pod_wins():
    env = detect({**pytorchjob_env(1, PET_NPROC_PER_NODE="2"), **TORCHRUN_CHILD})
    assert facts(env) == (3, 4, 1, 2, 1, "torchrun")


def test_pytorchjob_with_several_processes_per_pod_must_use_unifit_launch():
    with pytest.raises(ConfigError, match="PET_NPROC_PER_NODE=4.*unifit launch --nproc-per-node 4"):
        detect(pytorchjob_env(0, replicas=8, PET_NPROC_PER_NODE="4"))


@pytest.mark.parametrize("name, value", [("RANK", "zero"), ("WORLD_SIZE", "0"), ("MASTER_PORT", "port"), ("RANK", "3")])
def test_bad_pytorchjob_variable_is_a_config_error_naming_it(name, value):
    with pytest.raises(ConfigError, match=name):
        detect(pytorchjob_env(0, **{name: value}))


# ---- Kubeflow Trainer v2 (TrainJob) ----------------------------------------------------------------------


def trainjob_env(node: int, nodes: int = 2, per_pod: str = "1", port: int = 29500, **extra: str) -> dict[str, str]:
    """What a TrainJob's torch runtime sets in the pod of node `node`: PET_* alone (no RANK, no WORLD_SIZE)."""
    return {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": per_pod,
        "PET_NODE_RANK": str(node),
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": str(port),
        **extra,
    }


def test_trainjob_pod_running_unifit_fit_is_one_rank_of_the_pods():
    env = detect(trainjob_env(1, nodes=3))
    assert facts(env) == (1, 3, 0, 1, 1, "trainjob")
    assert (env.master_addr, env.master_port) == ("job-node-0-0.job", 29500)
    assert detect(trainjob_env(0, nodes=1, per_pod="auto")).world_size == 1  # auto on a CPU pod: one process


def test_trainjob_pod_asked_for_several_processes_says_to_use_unifit_launch():
    with pytest.raises(ConfigError, match=r"PET_NPROC_PER_NODE=4: this TrainJob pod must run 4 .*unifit launch -c"):
        detect(trainjob_env(0, per_pod="4"))


@pytest.mark.parametrize(
    "name, value",
    [("PET_NODE_RANK", "2"), ("PET_NNODES", "two"), ("PET_MASTER_PORT", "port"), ("PET_NPROC_PER_NODE", "0")],
)
def test_bad_trainjob_variable_is_a_config_error_naming_it(name, value):
    with pytest.raises(ConfigError, match=name):
        detect(trainjob_env(0, **{name: value}))


def test_unifit_launch_in_a_trainjob_pod_takes_its_flags_from_pet(cli, monkeypatch, clean_environment):
    """The flags not given come from PET_*; given ones win (torchrun reads PET_* the same way)."""
    specs = []

    class Recording:
        def __init__(self, name: str) -> None:
            pass

        def launch(self, spec):
            specs.append(spec)
            return 0

    monkeypatch.setattr(registry, "launcher", Recording)
    example = ["-c", "examples/digits/torch.yaml", "--trainer.strategy", "ddp"]
    assert cli("launch", *example, env=trainjob_env(1, nodes=2, per_pod="2", port=23456)).returncode == 0
    assert cli("launch", "--nproc-per-node", "1", *example, env=trainjob_env(0, nodes=2, per_pod="2")).returncode == 0
    assert cli("launch", *example).returncode == 0  # no pod: one process on one node
    got = [(s.nproc_per_node, s.nnodes, s.node_rank, s.master_addr, s.master_port) for s in specs]
    assert got == [(2, 2, 1, "job-node-0-0.job", 23456), (1, 2, 0, "job-node-0-0.job", 29500), (1, 1, 0, None, None)]


@pytest.mark.launch
@pytest.mark.timeout(150)
def test_two_trainjob_pods_train_as_one_pod_of_two_torchrun_ranks(tmp_path, clean_environment):
    """Two pods whose command is `unifit fit` (PET_* only) form one world of two; one pod asked for two processes,
    whose command is a bare `unifit launch`, starts two torchrun ranks from PET_*. They train the same weights."""
    pods, launched = tmp_path / "pods", tmp_path / "launched"
    port = free_port()
    other = next(p for p in iter(free_port, None) if p != port)
    local = {"PET_MASTER_ADDR": "127.0.0.1"}
    commands = [(fit_args(pods), trainjob_env(r, port=port, **local)) for r in range(2)]
    commands.append((["launch", *fit_args(launched)[1:]], trainjob_env(0, nodes=1, per_pod="2", port=other, **local)))
    results = run_together(commands, timeout=120)
    assert_one_world_trained(results[:2], pods, 2)
    assert_one_world_trained(results[2:], launched, 2)
    assert {r["weights_sha256"] for r in reports(pods)} == {r["weights_sha256"] for r in reports(launched)}


# ---- Kubeflow TFJob (TF_CONFIG) ------------------------------------------------------------------------


def tfjob_config(kind: str, index: int) -> str:
    """TF_CONFIG as the training operator writes it for a TFJob with 1 Chief, 2 Workers (and maybe PS)."""
    cluster = {"chief": ["job-chief-0.ns.svc:2222"], "worker": ["job-worker-0.ns.svc:2222", "job-worker-1.ns.svc:2222"]}
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}, "environment": "cloud"})


def test_tfjob_chief_and_workers():
    chief = detect({"TF_CONFIG": tfjob_config("chief", 0)})
    assert facts(chief) == (0, 3, 0, 1, 0, "tf_config")
    assert (chief.master_addr, chief.master_port) == ("job-chief-0.ns.svc", 2222)
    assert facts(detect({"TF_CONFIG": tfjob_config("worker", 1)}))[:2] == (2, 3)
    workers_only = json.dumps({"cluster": {"worker": ["w0:2222", "w1:2222"]}, "task": {"type": "worker", "index": 1}})
    assert facts(detect({"TF_CONFIG": workers_only}))[:2] == (1, 2)


@pytest.mark.parametrize("kind", ["ps", "evaluator", "master"])
def test_tfjob_task_types_mwms_does_not_run_are_a_clear_error(kind):
    with pytest.raises(ConfigError, match=f"task type '{kind}'.*chief"):
        detect({"TF_CONFIG": tfjob_config(kind, 0)})


# ---- real processes ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def fit_args(root) -> list[str]:
    report = {"class_path": "tests.probe.callbacks.ProbeReport", "init_args": {"out_dir": str(root / "reports")}}
    return [
        "fit",
        "-c",
        str(PROBE_YAML),
        "--trainer.strategy",
        "ddp",
        "--trainer.root_dir",
        str(root),
        "--trainer.max_epochs",
        "2",
        "--trainer.callbacks",
        json.dumps([report]),
    ]


def run_ranks(envs: list[dict[str, str]], root, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """One `unifit fit` per environment, all at once."""
    return run_together([(fit_args(root), env) for env in envs], timeout)


def assert_one_world_trained(results, root, world: int) -> None:
    for result in results:
        assert_ok(result)
    found = reports(root)
    assert [r["rank"] for r in found] == list(range(world)) and {r["world_size"] for r in found} == {world}
    assert len({r["weights_sha256"] for r in found}) == 1  # one DDP world: identical replicas
    for epoch in range(2):  # disjoint shards that cover the data
        assert sorted(i for r in found for i in r["seen"][f"train_epoch_{epoch}"]) == list(range(64))


def slurm_job_with_free_port() -> str:
    """A job id whose derived rendezvous port is free here (the test uses the derived port, not MASTER_PORT)."""
    for job in range(90001, 90200):
        if port_is_free(slurm_port(str(job), "0")):
            return str(job)
    raise AssertionError("no free port among the derived ones")


@pytest.mark.launch
@pytest.mark.timeout(150)
def test_two_srun_tasks_form_one_world_and_train(tmp_path, clean_environment):
    job = slurm_job_with_free_port()
    envs = [
        {**srun_env(r, ntasks=2, per_node=2), "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "localhost"} for r in range(2)
    ]
    results = run_ranks(envs, tmp_path)
    assert_one_world_trained(results, tmp_path, 2)


@pytest.mark.launch
@pytest.mark.timeout(150)
def test_two_pytorchjob_pods_form_one_world_and_train(tmp_path, clean_environment):
    port = str(free_port())
    envs = [pytorchjob_env(r, replicas=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(2)]
    results = run_ranks(envs, tmp_path)
    assert_one_world_trained(results, tmp_path, 2)


def test_detect_reads_the_process_environment(monkeypatch, clean_environment):
    for name, value in srun_env(1).items():
        monkeypatch.setenv(name, value)
    assert facts(environment.detect()) == (1, 2, 1, 2, 0, "slurm")


@pytest.mark.launch
@pytest.mark.timeout(150)
def test_unifit_launch_in_one_srun_task_per_node_starts_torchrun_ranks(tmp_path, clean_environment):
    # `srun --ntasks-per-node 1 unifit launch --nproc-per-node 2`: the ranks inherit SLURM_PROCID=0,
    # SLURM_NTASKS=1 of the task, and must still be ranks 0 and 1 of torchrun's world of 2
    slurm = {**srun_env(0, ntasks=1, per_node=1), "SLURM_JOB_NODELIST": "localhost"}
    args = ["launch", "--nproc-per-node", "2", *fit_args(tmp_path)[1:]]
    result = run_unifit(*args, env=slurm, timeout=120)
    assert_one_world_trained([result], tmp_path, 2)


@pytest.mark.timeout(60)
def test_bad_slurm_variable_ends_fit_with_one_line_and_exit_2(tmp_path, clean_environment, cli):
    result = cli(*fit_args(tmp_path), env=srun_env(0, SLURM_NTASKS="two"))
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "SLURM_NTASKS" in line]
    assert len(lines) == 1 and "'two'" in lines[0], result.stderr


@pytest.mark.launch
@pytest.mark.tf
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy, yaml", [("horovod", PROBE_YAML), ("mwms", KERAS_PROBE_YAML)])
def test_srun_fit_of_a_strategy_that_needs_its_launcher_is_refused(tmp_path, clean_environment, strategy, yaml):
    """`srun unifit fit` with horovod or mwms would start N processes that each train alone: refused.
    In a real process: under srun it is a launched rank, which main() ends with os._exit."""
    result = run_unifit(
        "fit",
        "-c",
        str(yaml),
        "--trainer.strategy",
        strategy,
        "--trainer.root_dir",
        str(tmp_path),
        env=srun_env(0, ntasks=2, per_node=2),
        timeout=80,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "each would train alone" in line]
    assert len(lines) == 1 and "unifit launch" in lines[0], result.stderr[-2000:]
