"""Import optional dependencies by dotted path, turning a missing one into a clear fix."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from unifit.errors import MissingExtraError

# top-level package -> the unifit extra that installs it
_EXTRA_FOR_PACKAGE = {
    "torch": "torch",
    "tensorflow": "tf",
    "keras": "tf",
    "horovod": "horovod",
    "s3fs": "s3",
    "tensorboard": "torch",
    "tqdm": "torch",
    "mlflow": "tracking",
    "wandb": "tracking",
}


def require(package: str, *, purpose: str) -> Any:
    """Import `package` or raise MissingExtraError naming `pip install unifit[extra]`."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        root = package.split(".")[0]
        extra = _EXTRA_FOR_PACKAGE.get(root, "all")
        raise MissingExtraError(
            f"{purpose} needs the Python package '{root}', which is not importable ({exc}); "
            f"fix: pip install 'unifit[{extra}]'"
        ) from exc


LIGHTNING = ("lightning", "pytorch_lightning")


def derives_from(obj: Any, name: str, *packages: str) -> bool:
    """Whether `obj` is an instance of a class called `name` from one of `packages` (top-level names), asked by name so
    that the package (Lightning, Keras, TensorFlow) is not imported to ask."""
    return any(c.__name__ == name and c.__module__.split(".")[0] in packages for c in type(obj).__mro__)


def tensorboard_without_tensorflow() -> None:
    """TensorBoard's writer resolves `tensorboard.compat.tf`, which imports TensorFlow whenever it is
    installed: seconds of start-up, ~500 MB of memory and TensorFlow's log lines in a PyTorch run.
    Its documented switch, an importable `tensorboard.compat.notf`, selects its own stub instead;
    set only where TensorFlow is not loaded already (a Keras run keeps it)."""
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))


def load_object(path: str, *, field: str) -> Any:
    """Import 'pkg.module.Name' or 'pkg.module:Name'; errors name the config `field`."""
    from unifit.errors import ConfigError

    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{field}: received '{path}', expected a dotted path like 'package.module.ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if root in _EXTRA_FOR_PACKAGE and not module_name.startswith(root):
            raise MissingExtraError(
                f"{field}: '{path}' needs the Python package '{root}', which is not installed; "
                f"fix: pip install 'unifit[{_EXTRA_FOR_PACKAGE[root]}]'"
            ) from exc
        if exc.name and module_name.startswith(exc.name):
            raise ConfigError(
                f"{field}: received '{path}', but module '{exc.name}' was not found; "
                "fix the dotted path or run from the directory that contains the package"
            ) from exc
        raise
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{field}: received '{path}', but module '{module_name}' has no attribute '{attr}'") from None
