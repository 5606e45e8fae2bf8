"""The metric a checkpoint or early stopping monitors, checked against what the module logged: a name that
differs from a logged one only in its separators ('val_acc' for 'val/acc') is refused at the first
validation that logs it; any other unknown name when it is first needed (at an epoch's end, once every
metric of the epoch is in), with a 'did you mean'."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

from unifit.errors import ConfigError


def _words(name: str) -> str:
    return re.sub(r"[/_.\-\s]+", " ", name).strip().lower()


def closest(monitor: str, logged: Iterable[str]) -> str | None:
    """The logged name `monitor` most likely meant, or None."""
    names = sorted(logged)
    same = [name for name in names if _words(name) == _words(monitor)]
    if same:
        return same[0]
    by_words = {_words(name): name for name in names}
    close = difflib.get_close_matches(_words(monitor), list(by_words), n=1, cutoff=0.75)
    return by_words[close[0]] if close else None


def check_monitor(field: str, monitor: str | None, logged: Iterable[str], *, final: bool) -> None:
    """Refuse `monitor` when it is not among `logged`: always where `final` (every metric is in), else only
    when a logged name is the same words spelt with other separators (certainly a typo)."""
    names = set(logged)
    if monitor is None or monitor in names:
        return
    meant = closest(monitor, names)
    if not final and (meant is None or _words(meant) != _words(monitor)):
        return
    hint = f" (did you mean '{meant}'?)" if meant else ""
    raise ConfigError(
        f"{field}: '{monitor}' was not logged{hint}; logged metrics: {', '.join(sorted(names)) or '(none)'}; "
        f"set {field} to one of them"
    )
