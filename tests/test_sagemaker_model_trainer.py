"""SageMaker SDK 3: a unifit job as `ModelTrainer` runs it, with unifit installed the way docs/sagemaker.md says.

The SDK's own code does everything it does on AWS but start the instances: it stages the source directory and its
drivers, writes /opt/ml's config per instance and runs `sm_train.sh` (which installs requirements.txt, exports the
SM_* environment and runs the torchrun or basic driver). Its LOCAL_CONTAINER mode runs that through `docker compose
up`; on this machine Docker is tests/probe/compose_shim.py (each instance in mount and network namespaces of its own,
the Python environment as the image, what pip installs there kept out of this machine's environment).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, start_python, stop
from tests.netns import unavailable

needs_namespaces = pytest.mark.skipif(
    bool(unavailable()) or shutil.which("unshare") is None,
    reason=f"stands in for Docker with mount and network namespaces: {unavailable() or 'no unshare command'}",
)

HYPERPARAMETERS = {
    "config": "exp.yaml",
    # nested: SDK 3's sm_train.sh exports every hyperparameter as SM_HP_<NAME>, which a dotted name cannot be
    "trainer": {"max_epochs": 4, "root_dir": "runs/digits", "checkpoint": {"dir": "runs/digits/ckpt"}},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    """`source_dir` as docs/sagemaker.md lays it out: the entry point, the experiment and the user's code, a wheel
    of unifit (`pip wheel --no-deps . -w src/`) and a requirements.txt naming it."""
    base = tmp_path_factory.mktemp("sm3")
    project = base / "project"  # a copy, so the build leaves nothing in the repository
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, project / name)
    shutil.copytree(REPO / "unifit", project / "unifit", ignore=shutil.ignore_patterns("__pycache__"))
    src = base / "src"
    (src / "examples").mkdir(parents=True)
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", ".", "-w", src]
    subprocess.run(build, cwd=project, check=True, timeout=300)
    wheel = next(src.glob("unifit-*.whl")).name
    (src / "requirements.txt").write_text(f"./{wheel}\n")
    shutil.copy(REPO / "examples" / "sagemaker" / "train.py", src / "train.py")
    shutil.copy(REPO / "examples" / "digits" / "torch.yaml", src / "exp.yaml")
    shutil.copy(REPO / "examples" / "digits" / "keras.yaml", src / "keras.yaml")
    shutil.copy(REPO / "examples" / "__init__.py", src / "examples" / "__init__.py")
    shutil.copytree(REPO / "examples" / "digits", src / "examples" / "digits", ignore=shutil.ignore_patterns("*.pyc"))
    docker = base / "bin" / "docker"
    docker.parent.mkdir()
    docker.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO / "tests" / "probe" / "compose_shim.py"} "$@"\n')
    docker.chmod(0o755)
    return src


def _model_trainer(root: Path, src: Path, instances: int, torchrun: int, hyperparameters: dict) -> subprocess.Popen:
    root.mkdir()
    environment = {"OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(_free_port())}  # torchrun's port, read by it
    args = [str(root), str(src), str(instances), str(torchrun), json.dumps(hyperparameters), json.dumps(environment)]
    shims = src.parent / "bin"
    env = {"PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ['PATH']}", "AWS_DEFAULT_REGION": "us-east-1"}
    return start_python("-m", "tests.probe.sagemaker_model_trainer", *args, env=env)


def _finish(jobs: dict[str, tuple[Path, subprocess.Popen]], timeout: float) -> dict[str, str]:
    """Every job's output once it ended well; the network namespaces of a job killed here are removed."""
    try:
        outputs = {name: "\n".join(stop(proc, timeout=timeout)) for name, (_, proc) in jobs.items()}
    finally:
        for root, _ in jobs.values():
            listed = root / ".shim" / "namespaces"
            for namespace in listed.read_text().split() if listed.exists() else []:
                subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    for name, (_, proc) in jobs.items():
        assert proc.returncode == 0, f"{name}:\n{outputs[name][-8000:]}"
        assert "world size 2" in outputs[name], outputs[name][-4000:]
        assert "Successfully installed unifit-" in outputs[name], outputs[name][-4000:]
    return outputs


def _check_job(root: Path, epochs: int) -> tarfile.TarFile:
    """The job trained `epochs` epochs into its output.tar.gz, with unifit installed in each instance only; its
    model.tar.gz, open."""
    with tarfile.open(root / "compressed_artifacts" / "output.tar.gz") as output:
        lines = output.extractfile("data/runs/digits/metrics.jsonl").read().decode().splitlines()
        assert any(n.startswith(f"data/runs/digits/ckpt/epoch={epochs:04d}") for n in output.getnames())
    last = json.loads(lines[-1])
    assert (last["epoch"], len(lines)) == (epochs, epochs), lines  # trainer.max_epochs, a nested hyperparameter
    assert last["val/acc"] > 0.9
    # the wheel went into each instance's own layer over the environment, not into this machine's
    layers = list((root / ".shim").glob("algo-*/env/upper"))
    assert layers and all(list(layer.glob("lib/python*/site-packages/unifit-*.dist-info")) for layer in layers)
    site_packages = Path(sysconfig.get_paths()["purelib"])
    assert list(site_packages.glob("__editable__*unifit*")), "the tests' editable install of unifit was replaced"
    return tarfile.open(root / "compressed_artifacts" / "model.tar.gz")


@needs_namespaces
@pytest.mark.launch
@pytest.mark.timeout(400)
def test_torch_jobs_train_with_unifit_installed_from_the_source_dir(tmp_path, source_dir):
    """Torchrun(2) on one instance (the SDK's torchrun driver), and two instances without `distributed` (unifit
    starts torchrun on each, algo-1 the master): one world of 2 either way, the same model."""
    two_instances = {**HYPERPARAMETERS, "master-port": _free_port()}
    jobs = {
        "torchrun": (tmp_path / "torchrun", _model_trainer(tmp_path / "torchrun", source_dir, 1, 2, HYPERPARAMETERS)),
        "two-instances": (tmp_path / "two", _model_trainer(tmp_path / "two", source_dir, 2, 0, two_instances)),
    }
    _finish(jobs, timeout=360)
    models = {}
    for name, (root, _) in jobs.items():
        with _check_job(root, epochs=4) as model:
            models[name] = torch.load(model.extractfile("model.pt"), weights_only=True)
    for key, value in models["torchrun"].items():
        assert torch.equal(value, models["two-instances"][key]), key


@needs_namespaces
@pytest.mark.launch
@pytest.mark.tf
@pytest.mark.timeout(400)
def test_keras_mwms_job_on_two_instances(tmp_path, source_dir):
    """Keras, no `distributed`: unifit starts a TensorFlow worker on each instance (TF_CONFIG from SM_HOSTS)."""
    hyperparameters = {
        "config": "keras.yaml",
        "master-port": _free_port(),
        "trainer": {**HYPERPARAMETERS["trainer"], "strategy": "mwms", "max_epochs": 3},
    }
    root = tmp_path / "mwms"
    _finish({"mwms": (root, _model_trainer(root, source_dir, 2, 0, hyperparameters))}, timeout=360)
    with _check_job(root, epochs=3) as model:
        assert model.getnames() == ["model.weights.h5"]


def test_the_images_docs_name_are_the_sdks_that_can_run_unifit():
    """docs/sagemaker.md's image table is the SDK's own (versions with Python >= 3.11 and torch >= 2.4 or
    TensorFlow >= 2.16), so a newer SDK's images show up here."""
    import re

    import sagemaker.core

    table = Path(sagemaker.core.__file__).parent / "image_uri_config"
    page = (REPO / "docs" / "sagemaker.md").read_text()
    for image, framework, oldest in (("pytorch-training", "pytorch", (2, 4)), ("tensorflow-training", "tensorflow", (2, 16))):  # fmt: skip
        row = next(line for line in page.splitlines() if line.startswith(f"| `{image}` |"))
        documented = {
            (version, py)
            for chunk in row.split("|")[2].split(";")
            for py in re.findall(r"\((py\d+)\)", chunk)
            for version in re.findall(r"\d+\.\d+\.\d+", chunk)
        }
        versions = json.loads((table / f"{framework}.json").read_text())["training"]["versions"]
        usable = {
            (version, py)
            for version, spec in versions.items()
            for py in spec.get("py_versions", [])
            if tuple(map(int, version.split(".")[:2])) >= oldest and int(py[2:]) >= 311
        }
        assert documented == usable, (image, sorted(usable))
