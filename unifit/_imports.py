"""Import optional dependencies by dotted path, turning a missing one into a clear fix."""

from __future__ import annotations

import importlib
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
