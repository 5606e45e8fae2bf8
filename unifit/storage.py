"""Storage locations: local paths or fsspec URLs (s3://...), checked before training starts.

Options for the file system (endpoint_url, profile, key/secret, ...) come from
`trainer.storage_options` or, for S3, from the standard AWS environment and config files.
Secrets in them are never written to logs, the saved config or error messages (`redact`).
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from pathlib import Path
from typing import Any

import fsspec

from unifit.errors import ConfigError, first_line

_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s]+@")
_SECRET = re.compile(r"(secret|password|token|key|credential)", re.IGNORECASE)
_PROTOCOL_EXTRA = {"s3": "s3", "s3a": "s3"}


# names that hold a secret wherever they are in an experiment (module/data init_args too): strict, so that
# `tokenizer` or `num_tokens` stay readable
_SECRET_NAME = re.compile(
    r"(^|_)(secret|password|passwd|token|api_key|apikey|access_key|secret_key|private_key|credentials?)$", re.I
)


def redact_secret_names(value: Any) -> Any:
    """A copy with the values of keys named like secrets (`api_key`, `hf_token`, `password`...) as '***', and
    credentials inside URLs hidden, anywhere in nested dicts and lists."""
    if isinstance(value, dict):
        return {
            k: ("***" if _SECRET_NAME.search(str(k)) and not isinstance(v, dict) else redact_secret_names(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact_secret_names(v) for v in value]
    return redact_url(value) if isinstance(value, str) else value


def redact(options: Any) -> Any:
    """A copy of `options` with every secret-looking value replaced by '***'."""
    if isinstance(options, dict):
        return {
            k: ("***" if _SECRET.search(str(k)) and not isinstance(v, dict) else redact(v)) for k, v in options.items()
        }
    if isinstance(options, list):
        return [redact(v) for v in options]
    return redact_url(options) if isinstance(options, str) else options


def redact_url(url: str) -> str:
    """'https://user:token@host/x' -> 'https://***@host/x' (anywhere in a text, an error message say): credentials
    inside a URL are secrets too."""
    return _USERINFO.sub(r"\1***@", url)


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def filesystem(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(file system, path) for a local path or URL; a missing backend names its pip extra."""
    try:
        return fsspec.core.url_to_fs(url, **(options or {}) if is_remote(url) else {})
    except ImportError as exc:
        protocol = url.split("://", 1)[0]
        extra = _PROTOCOL_EXTRA.get(protocol, "all")
        raise ConfigError(
            f"'{url}' needs the file system for {protocol}:// ({exc}); fix: pip install 'unifit[{extra}]'"
        ) from None
    except ValueError as exc:
        raise ConfigError(f"'{url}': {exc}; use a local path or a URL like s3://bucket/prefix") from None


def _check_local_dir(path: str, field: str) -> None:
    """Create the directory and a file in it, then remove what the check created (a failed run
    leaves nothing behind)."""
    created, probe = [], Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        created.append(probe)
        probe = probe.parent
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".unifit-write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{field}: '{path}' cannot be created or written: {exc.strerror or first_line(exc)}"
            f"{f' ({exc.filename})' if exc.filename else ''}; choose a writable directory"
        ) from None
    finally:
        for directory in created:  # deepest first
            try:
                directory.rmdir()
            except OSError:
                break


def check_writable(url: str, options: dict[str, Any] | None, field: str) -> None:
    """Write and delete a tiny object under `url`, so a missing bucket or bad credentials
    stop the run before training, with the URL and what to fix. A local directory is created
    (a path under a read-only or virtual file system fails here, in one line)."""
    if not is_remote(url):
        _check_local_dir(filesystem(url)[1], field)  # as fsspec resolves it: file://, ~
        return
    fs, path = filesystem(url, options)
    probe = f"{path.rstrip('/')}/.unifit-write-check-{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)
    except FileNotFoundError:
        raise ConfigError(
            f"{field}: '{url}' cannot be written: the bucket does not exist; create it or fix the URL"
        ) from None
    except PermissionError as exc:
        raise ConfigError(
            f"{field}: '{url}' cannot be written: access denied ({first_line(exc)}); check the credentials "
            "(AWS_PROFILE, AWS_ACCESS_KEY_ID, trainer.storage_options) and the bucket policy"
        ) from None
    except Exception as exc:  # endpoint unreachable, bad endpoint_url, ...
        raise ConfigError(
            f"{field}: '{url}' cannot be written: {type(exc).__name__}: {first_line(exc)}; "
            "check the endpoint and network"
        ) from None
