"""The launching process checks the experiment's classes from their source files, without importing the user's
framework; what it reads equals what importing gives, and whatever it cannot be certain of is imported as before."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO
from unifit.config.init_args import check
from unifit.config.source_signature import signature_from_source
from unifit.errors import ConfigError

READ_FROM_SOURCE = [
    "tests.probe.keras_probe.KerasProbe",
    "tests.probe.probe.ProbeModule",
    "tests.probe.callbacks.ProbeReport",
    "tests.probe.tiny_gpt.TinyGPT",
    "tests.probe.tiny_gpt_lightning.LightningTP",
    "tests.probe.lightning_probe.Regressor",
    "examples.digits.data.DigitsData",
]


@pytest.mark.parametrize("class_path", READ_FROM_SOURCE)
def test_the_signature_read_from_source_is_the_imported_classes(class_path, monkeypatch):
    module_name, _, name = class_path.rpartition(".")
    monkeypatch.delitem(sys.modules, module_name, raising=False)  # read from the file, as in a fresh process
    found = signature_from_source(class_path)
    assert found is not None and found[0] == name
    imported = inspect.signature(getattr(importlib.import_module(module_name), name), eval_str=True)
    mine = found[1].parameters
    assert list(mine) == list(imported.parameters)
    for p in imported.parameters.values():
        assert mine[p.name].kind is p.kind, p.name
        assert (mine[p.name].default is p.empty) is (p.default is p.empty), p.name
        assert mine[p.name].annotation == p.annotation, p.name


UNCERTAIN = {
    "inherited": "class Base:\n    def __init__(self, a: int = 1): ...\nclass C(Base):\n    pass\n",
    "decorated": "import dataclasses\n@dataclasses.dataclass\nclass C:\n    a: int = 1\n    def __init__(self, a: int = 1): ...\n",
    "metaclass": "class C(metaclass=type):\n    def __init__(self, a: int = 1): ...\n",
    "own_type": "class Size(int): ...\nclass C:\n    def __init__(self, a: Size = 1): ...\n",
    "attribute_hint": "import typing\nclass C:\n    def __init__(self, a: typing.Optional[int] = None): ...\n",
    "rebound_builtin": "int = str\nclass C:\n    def __init__(self, a: int = 1): ...\n",
    "missing_package": "import no_such_package_here\nclass C:\n    def __init__(self, a: int = 1): ...\n",
    "syntax_error": "class C:\n    def __init__(self, a: int = 1) ...\n",
    "bound_twice": "class C:\n    def __init__(self, a: int = 1): ...\nC = dict\n",
    "a_new": "class C:\n    def __new__(cls, *a): ...\n    def __init__(self, a: int = 1): ...\n",
}


@pytest.mark.parametrize("case", sorted(UNCERTAIN))
def test_what_the_source_cannot_say_for_certain_is_imported(case, tmp_path, monkeypatch):
    module = f"uncertain_{case}"
    (tmp_path / f"{module}.py").write_text(UNCERTAIN[case])
    monkeypatch.syspath_prepend(str(tmp_path))
    assert signature_from_source(f"{module}.C") is None


def test_a_refusal_comes_from_the_imported_check_in_its_words(tmp_path, monkeypatch):
    """A wrong argument read from the source is checked again by importing: the message is the import's."""
    (tmp_path / "plain_module.py").write_text(
        textwrap.dedent(
            """
            from typing import Optional

            class Plain:
                def __init__(self, size: int, rate: float = 0.1, name: Optional[str] = None, *, flag: bool = False):
                    pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    check("plain_module.Plain", {"size": "3", "rate": "1e-3", "flag": True}, "module")  # as pydantic coerces them
    assert "plain_module" not in sys.modules  # checked from the source
    with pytest.raises(ConfigError, match=r"'module.init_args.size' received 'three'.*Plain.__init__"):
        check("plain_module.Plain", {"size": "three"}, "module")
    assert "plain_module" in sys.modules  # the refusal is the import's


@pytest.mark.launch
def test_checking_a_keras_experiment_before_launch_imports_no_framework():
    """What `unifit launch` does before its ranks start, in a fresh interpreter."""
    code = (
        "import sys; from unifit.cli.main import load_experiment; "
        "load_experiment('tests/probe/keras_probe.yaml', {'module.init_args.n_train': '32'}); "
        "print(sorted(m for m in ('tensorflow', 'keras', 'torch') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.launch
def test_a_module_checked_from_its_source_is_still_built_from_the_seed():
    """The class is imported (torch with it) before the seed is set and the module built: two fresh processes build
    the same initial weights, as the ranks of a launch must."""
    code = (
        "import argparse, hashlib; from unifit.cli.main import _experiment_objects; "
        "args = argparse.Namespace(config='tests/probe/probe.yaml'); "
        "_, module, _ = _experiment_objects(args, {}); "
        "print(hashlib.sha256(b''.join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest())"
    )
    digests = [
        subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
        for _ in range(2)
    ]
    assert all(d.returncode == 0 for d in digests), digests[0].stderr
    assert digests[0].stdout == digests[1].stdout and len(digests[0].stdout.strip()) == 64
