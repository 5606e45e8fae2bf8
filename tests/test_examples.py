"""The shipped examples run as written, from the repository root, and train.

Each example is run through its own file (the YAML, the batch script, the manifest), with overrides only for
where it writes and how long it trains, and must leave evidence that training happened: metrics.jsonl with
every epoch, an accuracy well above chance (0.1 for 10 digits), every rank's weights moved
(tests/examples_support/weights.py reports them), every rank present.

Cost (the CI budget): the in-process `cli` fixture wherever a real rank adds nothing (the plain PyTorch
loop and its port, the LightningModule in one process, the parameter-server YAML), one launch for each of
fsdp and model-parallel, and one real two-rank run each for the SLURM script and the Kubernetes manifest,
through the environment emulation of tests/test_cluster_environments.py (srun's and the PyTorchJob
operator's variables; gloo on CPU).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.examples_support.weights import read_reports
from tests.helpers import REPO, assert_ok, metrics_lines, run_together, run_unifit
from tests.test_cluster_environments import (
    free_port,
    pytorchjob_env,
    slurm_job_with_free_port,
    srun_env,
)

WEIGHTS_REPORT = "tests.examples_support.weights.WeightsReport"


def where_to_write(root: Path, epochs: int) -> list[str]:
    """Overrides every example takes in the tests: its outputs under `root`, `epochs` epochs, the weights report."""
    report = {"class_path": WEIGHTS_REPORT, "init_args": {"out_dir": str(root / "weights")}}
    return [
        *("--trainer.root_dir", str(root)),
        *("--trainer.checkpoint.dir", str(root / "checkpoints")),
        *("--trainer.tensorboard.log_dir", str(root / "tensorboard")),
        *("--trainer.max_epochs", str(epochs)),
        *("--trainer.callbacks", json.dumps([report])),
    ]


def output(result: subprocess.CompletedProcess) -> str:
    """What a run printed: its progress lines go to stdout, unifit's log lines to stderr (in-process: both stdout)."""
    return f"{result.stdout}\n{result.stderr}"


def assert_trained(root: Path, epochs: int, world: int, acc_key: str = "val/acc", min_acc: float = 0.85) -> list:
    """metrics.jsonl has every epoch, the last accuracy is well above chance, every rank reported moved weights."""
    lines = metrics_lines(root)
    assert [line["epoch"] for line in lines] == list(range(1, epochs + 1)), lines
    assert lines[-1][acc_key] >= min_acc, lines[-1]
    reports = read_reports(root / "weights")
    assert [r["rank"] for r in reports] == list(range(world)), reports
    assert {r["world_size"] for r in reports} == {world}, reports
    for r in reports:
        assert r["compared"] > 0 and r["moved"] == r["compared"] and r["max_change"] > 1e-3, r
        assert r["global_step"] == lines[-1]["step"], (r, lines[-1])
    assert list((root / "checkpoints").glob("epoch=*")), "no checkpoint written"
    return reports


@pytest.fixture
def one_thread():
    """torch computes on one thread in this process for the test (put back after): a 5k-parameter MLP gains
    nothing from more, and on a loaded 2-core machine two threads made the 3 epochs of the plain loop 4x slower
    (16 s instead of 3.5 s)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the digits examples of before: the two-rank ddp run ------------------------------------------------


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_digits_example_reaches_95_percent_with_two_ddp_processes(tmp_path):
    result = run_unifit(
        "launch",
        "--nproc-per-node",
        "2",
        "-c",
        "examples/digits/torch.yaml",
        "--trainer.root_dir",
        str(tmp_path),
        "--trainer.checkpoint.dir",
        str(tmp_path / "ckpt"),
        "--trainer.tensorboard.log_dir",
        str(tmp_path / "tb"),
        timeout=280,
    )
    assert_ok(result)
    assert "world size 2" in result.stdout and "final metrics" in result.stdout
    last = metrics_lines(tmp_path)[-1]
    assert last["epoch"] == 10
    assert last["val/acc"] >= 0.95, last
    assert last["lr"] == pytest.approx(0.1)  # base 0.05 x 2 replicas
    assert (tmp_path / "config.yaml").is_file() and list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "ckpt" / "best.json").is_file()


# ---- from a plain PyTorch loop: before and after ------------------------------------------------------------


@pytest.mark.timeout(120)
def test_plain_pytorch_loop_and_its_unifit_port_reach_the_same_accuracy(cli, tmp_path, capsys, one_thread):
    """The migration guide's two sides, 3 epochs each, in this process: the plain loop (its main(), as
    `python -m examples.from_pytorch.plain_loop` calls it) and exp.yaml through `unifit fit`."""
    import torch

    from examples.from_pytorch import plain_loop

    with torch.random.fork_rng():
        before = plain_loop.main(epochs=3, save_to=str(tmp_path / "plain.pt"))
        torch.manual_seed(0)
        untrained = plain_loop.MLP().state_dict()  # main()'s model as it started (the same seed)
    printed = capsys.readouterr().out
    assert [line.split()[1] for line in printed.splitlines() if line.startswith("epoch")] == ["1/3", "2/3", "3/3"]
    trained = torch.load(tmp_path / "plain.pt")
    assert all(not torch.equal(trained[name], untrained[name]) for name in untrained)
    assert before >= 0.9, printed

    root = tmp_path / "unifit"
    result = cli("fit", "-c", "examples/from_pytorch/exp.yaml", *where_to_write(root, 3))
    assert_ok(result)
    assert "strategy single, world size 1, global batch 32" in output(result), output(result)
    after = metrics_lines(root)[-1]["val/acc"]
    assert_trained(root, 3, 1, min_acc=0.9)
    assert abs(before - after) <= 0.05, (before, after)  # the same model, data and optimizer; other shuffles
    # the same network: the TrainModule holds the plain loop's nn.Module, unchanged
    from examples.from_pytorch.module import DigitsModule

    assert type(DigitsModule().model) is plain_loop.MLP


# ---- an unchanged LightningModule --------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_unchanged_lightning_module_trains_from_its_yaml(cli, tmp_path, one_thread):
    """`unifit fit -c examples/lightning/exp.yaml` as the README gives it (ddp in one process: a world of
    one); what a LightningModule does on several ranks is tests/test_lightning.py's."""
    import lightning as L

    import unifit
    from examples.lightning import module

    assert issubclass(module.LitDigits, L.LightningModule) and not issubclass(module.LitDigits, unifit.TrainModule)
    assert issubclass(module.DigitsDataModule, L.LightningDataModule)
    assert "import unifit" not in Path(module.__file__).read_text()  # nothing unifit in the user's classes

    result = cli("fit", "-c", "examples/lightning/exp.yaml", *where_to_write(tmp_path, 3))
    assert_ok(result)
    assert "strategy ddp, world size 1, global batch 32" in output(result), output(result)
    assert_trained(tmp_path, 3, 1, acc_key="val_acc", min_acc=0.85)
    lines = metrics_lines(tmp_path)
    assert lines[-1]["train_loss"] < lines[0]["train_loss"] and "train_acc" in lines[-1], lines
    assert lines[0]["lr"] < 0.05 and lines[-1]["lr"] < lines[0]["lr"]  # its cosine schedule, stepped per step


# ---- fsdp and model-parallel: one launch each -------------------------------------------------------------


def _whole_model_elements() -> int:
    from examples.digits.mlp_module import DigitsMLP

    return sum(p.numel() for p in DigitsMLP().parameters())


@pytest.mark.launch
@pytest.mark.timeout(240)
def test_fsdp_example_shards_the_model_over_two_ranks_and_trains(tmp_path):
    result = run_unifit(
        "launch", "--nproc-per-node", "2", "-c", "examples/digits/fsdp.yaml", *where_to_write(tmp_path, 2), timeout=200
    )
    assert_ok(result)
    assert "fsdp: 4 unit(s) sharded (Block)" in output(result), output(result)[-3000:]
    assert "strategy fsdp, world size 2, global batch 64" in output(result), output(result)[-3000:]
    reports = assert_trained(tmp_path, 2, 2, min_acc=0.9)
    whole = _whole_model_elements()
    # each rank holds half of every parameter: together the model once
    assert sum(r["elements_at_end"] for r in reports) == whole and max(r["elements_at_end"] for r in reports) < whole
    assert metrics_lines(tmp_path)[-1]["lr"] == pytest.approx(0.004)  # AdamW's 0.002 x 2 ranks


@pytest.mark.launch
@pytest.mark.timeout(240)
def test_model_parallel_example_splits_every_block_over_two_ranks_and_trains(tmp_path):
    result = run_unifit(
        "launch",
        *("--nproc-per-node", "2", "-c", "examples/digits/model_parallel.yaml"),
        *where_to_write(tmp_path, 2),
        timeout=200,
    )
    assert_ok(result)
    assert "2 rank(s) = 1 data-parallel x 2 tensor-parallel" in output(result), output(result)[-3000:]
    assert "9 layer(s) split over 2 ranks (4 colwise, 1 colwise_gather, 4 rowwise)" in output(result)
    reports = assert_trained(tmp_path, 2, 2, min_acc=0.9)
    whole = _whole_model_elements()
    # the split layers' halves on each rank, the rest (norms, the embedding, rowwise biases) on both
    held = {r["elements_at_end"] for r in reports}
    assert len(held) == 1 and whole * 0.5 < held.pop() < whole * 0.6, reports
    assert metrics_lines(tmp_path)[-1]["lr"] == pytest.approx(0.002)  # one data-parallel replica: not scaled


# ---- parameter-server: in this process ----------------------------------------------------------------------


@pytest.mark.tf
@pytest.mark.timeout(120)
def test_parameter_server_example_resolves_and_is_the_launched_keras_digits(cli):
    """Resolved in this process, not launched again: tests/test_ps_startup.py trains this very file through
    SageMaker's entry point (2 workers, 1 parameter server), and tests/test_parameter_server.py the same module
    and data through a killed worker, a checkpoint and a resume; a third TensorFlow cluster here would cost
    20-30 s of the CI budget. So this holds the example to those runs: the same module and data, a strategy and
    options the strategy accepts, init_args the classes take (print-config imports them), and the command in
    its header."""
    from unifit.strategies.parameter_server import ParameterServerOptions

    path = "examples/digits/parameter_server.yaml"
    result = cli("print-config", "-c", path)
    assert_ok(result)
    resolved = yaml.safe_load(result.stdout)
    launched = yaml.safe_load((REPO / "examples/digits/keras.yaml").read_text())
    assert (resolved["module"], resolved["data"]) == (launched["module"], launched["data"])
    trainer = resolved["trainer"]
    assert trainer["strategy"] == "parameter-server" and trainer["precision"] == "32-true"
    assert trainer["lr_scaling"] == "none"
    ParameterServerOptions.model_validate(trainer["strategy_options"])
    header = (REPO / path).read_text()
    assert f"unifit launch --nproc-per-node 2 --num-ps 1 -c {path}" in header
    # an option the strategy does not take is refused before anything starts
    bad = cli("print-config", "-c", path, "--trainer.strategy_options", "{max_shard: 2}")
    assert bad.returncode == 2 and "max_shard" in output(bad), output(bad)


# ---- clusters: the SLURM batch script and the Kubernetes manifest, through the environment emulation -----------


def parse_sbatch(path: Path) -> tuple[dict[str, str], list[list[str]]]:
    """The #SBATCH options ({'nodes': '1', 'requeue': ''}) and the script's commands, each as its words."""
    options: dict[str, str] = {}
    commands: list[list[str]] = []
    text = path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#SBATCH"):
            for word in shlex.split(line[len("#SBATCH") :], comments=True):
                key, _, value = word.lstrip("-").partition("=")
                options[key] = value
        elif line and not line.startswith("#"):
            commands.append(shlex.split(line, comments=True))
    return options, commands


@pytest.mark.launch
@pytest.mark.timeout(240)
def test_slurm_batch_script_trains_as_srun_tasks(tmp_path, clean_environment):
    """The script's srun line, run once per task with the variables srun sets (block distribution on one
    node, the world its #SBATCH lines ask for); the rendezvous is the one unifit derives from the job id."""
    options, commands = parse_sbatch(REPO / "examples/clusters/slurm.sbatch")
    assert {"requeue", "signal", "time"} <= set(options) and options["signal"].startswith("TERM@")
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    assert (nodes, per_node) == (1, 2)
    sruns = [c for c in commands if c[0] == "srun"]
    assert len(sruns) == 1 and commands == sruns, commands  # nothing else runs on the batch host
    program = [w for w in sruns[0][1:] if not w.startswith("-")][:1]
    assert program == ["unifit"], sruns[0]
    args = sruns[0][sruns[0].index("unifit") + 1 :]
    assert args[:3] == ["fit", "-c", "examples/digits/torch.yaml"] and "--ckpt-path" in args, args

    job = slurm_job_with_free_port()
    ntasks = nodes * per_node
    common = {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "localhost", "SLURM_CPUS_PER_TASK": options["cpus-per-task"]}
    envs = [{**srun_env(rank, ntasks=ntasks, per_node=per_node), **common} for rank in range(ntasks)]
    results = run_together([([*args, *where_to_write(tmp_path, 2)], env) for env in envs], timeout=180)
    for result in results:
        assert_ok(result)
    assert "strategy ddp, world size 2, global batch 64" in output(results[0]), output(results[0])[-3000:]
    reports = assert_trained(tmp_path, 2, ntasks)
    assert len({r["elements_at_end"] for r in reports}) == 1


@pytest.mark.launch
@pytest.mark.timeout(240)
def test_kubernetes_pytorchjob_trains_as_its_pods(tmp_path, clean_environment):
    """Every pod of the manifest (Master, then the Workers) runs its container's command with its env and
    the variables the training operator sets (MASTER_ADDR/PORT, WORLD_SIZE, RANK, PET_*); the test runs from
    the repository root, as the container runs from its workingDir."""
    manifest = yaml.safe_load((REPO / "examples/clusters/kubernetes.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert list(specs) == ["Master", "Worker"] and specs["Master"]["replicas"] == 1
    pods = []
    for kind in ("Master", "Worker"):
        (container,) = specs[kind]["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # the container the operator sets its variables on
        assert container["workingDir"].endswith("/unifit")  # the repository in the image: relative paths hold
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert container["workingDir"] + "/runs" in mounts  # torch.yaml's run directory, shared by the pods
        env = {e["name"]: str(e["value"]) for e in container.get("env", [])}
        pods += [(container["command"], env)] * specs[kind]["replicas"]
    assert len(pods) == 2
    for command, _ in pods:
        assert command[:4] == ["unifit", "fit", "-c", "examples/digits/torch.yaml"], command
        assert (REPO / command[3]).is_file()

    port = str(free_port())
    runs = []
    for rank, (command, env) in enumerate(pods):
        operator = pytorchjob_env(rank, replicas=len(pods), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        runs.append(([*command[1:], *where_to_write(tmp_path, 2)], {**env, **operator}))
    results = run_together(runs, timeout=180)
    for result in results:
        assert_ok(result)
    assert "strategy ddp, world size 2, global batch 64" in output(results[0]), output(results[0])[-3000:]
    assert_trained(tmp_path, 2, len(pods))


# ---- the index --------------------------------------------------------------------------------------------


def test_examples_readme_names_every_example_and_only_files_that_exist():
    """examples/README.md: a line for every runnable file (YAML, script, manifest, entry point), and every
    path its commands name exists (the commands run from the repository root)."""
    readme = (REPO / "examples" / "README.md").read_text()
    runnable = [
        p
        for p in sorted((REPO / "examples").rglob("*"))
        if p.suffix in {".yaml", ".sbatch"} or p.name in {"plain_loop.py", "make_shards.py", "train.py"}
    ]
    missing = [str(p.relative_to(REPO)) for p in runnable if str(p.relative_to(REPO)) not in readme]
    assert not missing, f"examples/README.md does not mention {missing}"
    named = set(re.findall(r"examples/[\w/.-]+\.(?:yaml|py|sbatch|md)", readme))
    assert named and not [n for n in named if not (REPO / n).is_file()], sorted(named)
    modules = set(re.findall(r"python -m (examples(?:\.\w+)+)", readme))
    assert all((REPO / (m.replace(".", "/") + ".py")).is_file() for m in modules), modules
