"""Packaging promises: import without optional frameworks, docs generated from the schema."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO


def test_config_reference_matches_the_schema():
    from unifit.cli.config_docs import render

    assert (REPO / "docs" / "config.md").read_text() == render(), (
        "docs/config.md is out of date: run python -m unifit.cli.config_docs > docs/config.md"
    )


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_torch_path_works_with_tensorflow_and_horovod_unimportable(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        for name in ("tensorflow", "keras", "horovod"):
            sys.modules[name] = None  # what Python does for a package that is not installed
        import unifit
        from tests.probe.probe import ProbeModule
        state = unifit.Trainer(max_epochs=1, root_dir={str(tmp_path)!r}, progress_bar=False).fit(ProbeModule())
        assert state.epoch == 1
        assert not any(m.split(".")[0] in ("tensorflow", "keras", "horovod") for m, v in sys.modules.items() if v)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr


@pytest.mark.launch
def test_import_unifit_imports_no_framework():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, unifit; print(sorted(m for m in ('torch', 'tensorflow') if m in sys.modules))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.strip() == "[]", result.stderr


def test_registry_refuses_a_module_of_another_framework():
    from unifit.errors import ConfigError
    from unifit.strategies import registry

    with pytest.raises(ConfigError, match="'ddp' trains torch modules, but KerasThing is a tensorflow module"):
        registry.check_framework("ddp", "tensorflow", "KerasThing")


def test_torchrun_launcher_passes_multi_node_flags_through():
    from unifit.strategies.launchers.base import LaunchSpec
    from unifit.strategies.launchers.torchrun import TorchrunLauncher

    launcher = TorchrunLauncher("ddp")
    one_node = launcher.torchrun_args(LaunchSpec(nproc_per_node=2, fit_args=["-c", "x.yaml"]))
    assert one_node == ["--nproc-per-node", "2", "--standalone", "-m", "unifit", "fit", "-c", "x.yaml"]
    spec = LaunchSpec(nproc_per_node=4, nnodes=2, node_rank=1, rdzv_endpoint="head:29400", fit_args=["-c", "x.yaml"])
    assert launcher.torchrun_args(spec) == [
        "--nproc-per-node",
        "4",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "head:29400",
        "-m",
        "unifit",
        "fit",
        "-c",
        "x.yaml",
    ]
    static = LaunchSpec(nproc_per_node=1, nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port=7777)
    assert "--master-addr" in launcher.torchrun_args(static) and "7777" in launcher.torchrun_args(static)


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_a_torch_run_with_tensorboard_does_not_load_tensorflow(tmp_path):
    """TensorBoard's writer would import TensorFlow when installed (seconds, ~500 MB, its log lines)."""
    code = (
        "import sys, unifit; from tests.probe.probe import ProbeModule; "
        f"unifit.Trainer(max_epochs=1, root_dir={str(tmp_path)!r}, progress_bar=False).fit(ProbeModule()); "
        "print('tensorflow loaded:', 'tensorflow' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert "tensorflow loaded: False" in result.stdout
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
