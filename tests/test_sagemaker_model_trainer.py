"""SageMaker SDK 3: a unifit job as `ModelTrainer` runs it, with unifit installed the way docs/sagemaker.md says.

The SDK's own code does everything it does on AWS but start the instances: it stages the source directory and its
drivers, writes /opt/ml's config per instance and runs `sm_train.sh` (which installs requirements.txt, exports the
SM_* environment and runs the torchrun or basic driver). Its LOCAL_CONTAINER mode runs that through `docker compose
up`; on this machine Docker is tests/probe/compose_shim.py (each instance in a mount namespace of its own, the
Python environment as the image, what pip installs there kept out of this machine's environment).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, start_python, stop

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="stands in for Docker with mount namespaces (unshare --mount): needs root",
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


def _artifacts(root: Path, name: str) -> tarfile.TarFile:
    return tarfile.open(root / "compressed_artifacts" / f"{name}.tar.gz")


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_model_trainer_jobs_train_with_unifit_installed_from_the_source_dir(tmp_path, source_dir):
    """Torchrun(2) on one instance (the SDK's torchrun driver), and two instances without `distributed` (unifit
    starts torchrun on each, algo-1 the master): one world of 2 either way, the same model."""
    port = _free_port()
    jobs = {
        "torchrun": _model_trainer(tmp_path / "torchrun", source_dir, 1, 2, HYPERPARAMETERS),
        "two-instances": _model_trainer(
            tmp_path / "two-instances", source_dir, 2, 0, {**HYPERPARAMETERS, "master-port": port}
        ),
    }
    outputs = {name: stop(proc, timeout=360) for name, proc in jobs.items()}
    for name, proc in jobs.items():
        assert proc.returncode == 0, f"{name}:\n" + "\n".join(outputs[name])[-8000:]
    models = {}
    for name in jobs:
        root = tmp_path / name
        out = outputs[name][0] + outputs[name][1]
        assert "world size 2" in out, out[-4000:]
        assert "Successfully installed unifit-" in out, out[-4000:]
        with _artifacts(root, "output") as output:
            lines = output.extractfile("data/runs/digits/metrics.jsonl").read().decode().splitlines()
            assert any(n.startswith("data/runs/digits/ckpt/epoch=0004") for n in output.getnames())
        assert json.loads(lines[-1])["val/acc"] > 0.9
        with _artifacts(root, "model") as model:
            models[name] = torch.load(model.extractfile("model.pt"), weights_only=True)
        # the wheel went into each instance's own layer over the environment, not into this machine's
        for layer in (root / ".shim").glob("algo-*/env/upper"):
            assert list(layer.glob("lib/python*/site-packages/unifit-*.dist-info")), layer
    for key, value in models["torchrun"].items():
        assert torch.equal(value, models["two-instances"][key]), key
    import unifit

    assert Path(unifit.__file__).is_relative_to(REPO)  # the editable install of the tests, unchanged
