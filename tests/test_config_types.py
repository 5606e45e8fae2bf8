"""init_args are checked against the class's __init__ type hints before any process starts, and nested
{class_path, init_args} objects are built into instances: through `unifit fit` and through the Python API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import unifit
from tests.helpers import assert_ok
from unifit.config import init_args
from unifit.config.loading import check_classes, parse_yaml, validate_experiment
from unifit.errors import ConfigError

HERE = __name__  # `unifit fit` imports the classes below from this file
LINEAR = {"class_path": "torch.nn.Linear", "init_args": {"in_features": 4, "out_features": 2}}


class BackboneModule(unifit.TrainModule):
    """Trains only its backbone's parameters: a backbone left as a dict used to fail in configure_optimizers."""

    def __init__(self, backbone: torch.nn.Module, lr: float = 0.05, n: int = 16, report: str | None = None) -> None:
        super().__init__()
        if not isinstance(lr, float):
            raise TypeError(f"lr arrived as {type(lr).__name__}")
        self.backbone, self.lr, self.n = backbone, lr, n
        if report:
            Path(report).write_text(json.dumps({"backbone": type(backbone).__name__, "lr": lr}))

    def train_dataset(self):
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(self.n, 4, generator=g), torch.randn(self.n, generator=g))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.backbone(x).sum(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.backbone.parameters(), lr=self.lr)


class Loose:
    """No hints and **kwargs: anything is accepted."""

    def __init__(self, anything, **extra) -> None:
        self.anything, self.extra = anything, extra


class Layers:
    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = layers


EXPERIMENT = """
module:
  class_path: {here}.BackboneModule
  init_args:
    backbone:
      class_path: torch.nn.Linear
      init_args:
        in_features: 4
        out_features: 2
    lr: "1e-3"
    report: {report}
trainer:
  root_dir: {root}
  max_epochs: 1
  batch_size: 8
  progress_bar: false
  checkpoint:
    enabled: false
  tensorboard:
    enabled: false
"""


def _experiment(tmp_path: Path) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT.format(here=HERE, report=tmp_path / "report.json", root=tmp_path / "run"))
    return path


@pytest.mark.timeout(120)
def test_fit_builds_nested_class_path_and_reads_a_string_float(tmp_path, cli):
    result = cli("fit", "-c", str(_experiment(tmp_path)))
    assert_ok(result)
    assert json.loads((tmp_path / "report.json").read_text()) == {"backbone": "Linear", "lr": 0.001}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "override, needles",
    [
        (
            ["--module.init_args.bogus", "1"],
            ["unknown argument 'module.init_args.bogus'", "backbone, lr, n, report", "remove it"],
        ),
        (["--module.init_args.n", "abc"], ["'module.init_args.n'", "'abc'", "integer", "type int"]),
        (
            [
                "--module.init_args.backbone",
                "{class_path: torch.nn.Linear, init_args: {in_features: abc, out_features: 2}}",
            ],
            ["'module.init_args.backbone.init_args.in_features'", "'abc'", "type int"],
        ),
        (
            ["--module.init_args.backbone", "{class_path: torch.nn.Linear, init_args: {out_features: 2}}"],
            ["'module.init_args.backbone.init_args.in_features' is required", "add it"],
        ),
        (
            ["--module.init_args.backbone.class_path", "torch.nn.NoSuchLayer"],
            ["module.init_args.backbone.class_path", "'torch.nn.NoSuchLayer'", "fix"],
        ),
        (
            ["--module.init_args.backbone.class_path", "collections.OrderedDict"],
            ["module.init_args.backbone.class_path", "not a torch.nn.modules.module.Module"],
        ),
        (
            ["--trainer.callbacks", f"[{{class_path: {HERE}.Layers, init_args: {{layers: 3}}}}]"],
            ["'trainer.callbacks.0.init_args.layers'", "3"],
        ),
    ],
)
def test_bad_init_args_give_one_line_and_exit_2_before_training(tmp_path, cli, override, needles):
    result = cli("fit", "-c", str(_experiment(tmp_path)), *override)
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stderr}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("unifit: error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert not (tmp_path / "report.json").exists()  # nothing was built


def test_python_api_checks_then_builds(tmp_path):
    config = validate_experiment(parse_yaml(EXPERIMENT.format(here=HERE, report="null", root=tmp_path)))
    check_classes(config)  # what `unifit fit/launch` runs before any process starts
    module = init_args.build(config.module.class_path, config.module.init_args, "module")
    assert isinstance(module.backbone, torch.nn.Linear) and module.lr == 0.001
    assert config.module.init_args["backbone"] == LINEAR  # the config keeps the plain mapping (saved with the run)


@pytest.mark.parametrize(
    "args, needle",
    [
        ({"backbone": LINEAR, "lr": "fast"}, "'module.init_args.lr' received 'fast'"),
        ({"backbone": LINEAR, "nn": 3}, "(did you mean 'n'?)"),
        ({"lr": 0.1}, "'module.init_args.backbone' is required by BackboneModule"),
        ({"backbone": 3}, "'module.init_args.backbone' received 3"),
        ({"backbone": {"class_path": "torch.nn.Linear", "args": {}}}, "'module.init_args.backbone.args'"),
    ],
)
def test_python_api_errors_name_the_field(args, needle):
    for step in (init_args.check, init_args.build):
        with pytest.raises(ConfigError) as info:
            step(f"{HERE}.BackboneModule", args, "module")
        assert needle in str(info.value) and "\n" not in str(info.value)


def test_untyped_arguments_and_kwargs_accept_anything():
    loose = init_args.build(f"{HERE}.Loose", {"anything": object, "more": "x", "nested": LINEAR}, "data")
    assert loose.anything is object and loose.extra["more"] == "x"
    assert isinstance(loose.extra["nested"], torch.nn.Linear)
    layers = init_args.build(f"{HERE}.Layers", {"layers": [LINEAR, LINEAR]}, "module")
    assert [type(layer) for layer in layers.layers] == [torch.nn.Linear, torch.nn.Linear]
    with pytest.raises(ConfigError, match=r"module\.init_args\.layers\.1\.class_path"):
        init_args.check(f"{HERE}.Layers", {"layers": [LINEAR, {"class_path": "collections.OrderedDict"}]}, "module")


def test_trainer_callbacks_are_checked_by_trainer_too():
    with pytest.raises(ConfigError, match=r"unknown argument 'trainer\.callbacks\.0\.init_args\.bogus'"):
        unifit.Trainer(callbacks=[{"class_path": "tests.probe.callbacks.ProbeReport", "init_args": {"bogus": 1}}])
