"""Read an experiment file, apply dotted command-line overrides, validate, and explain errors."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from unifit.config.init_args import check
from unifit.config.lightning_cli import unifit_form
from unifit.config.schema import ExperimentConfig, TrainerConfig
from unifit.errors import ConfigError


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where `1e-4` (no dot) is a string; YAML 1.2 and every user read it
    as a float. This loader resolves scientific notation with or without a dot as float."""


class _Yaml12Dumper(yaml.SafeDumper):
    """Quotes what _Yaml12Loader would read as a float (the string '1e5'), so a saved config reloads the same."""


_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""",
    re.X,
)
for _cls in (_Yaml12Loader, _Yaml12Dumper):
    _cls.yaml_implicit_resolvers = {k: list(v) for k, v in _cls.yaml_implicit_resolvers.items()}
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def parse_yaml(text: str) -> Any:
    """YAML text to Python values, with YAML 1.2 floats (`1e-4` is a float)."""
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506  a SafeLoader subclass


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Safely load a YAML mapping; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass an existing YAML file with -c")
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file '{path}' is not valid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{path}': expected a mapping with 'module' and 'trainer', received a {type(data).__name__}"
        )
    return data


def apply_overrides(data: dict[str, Any], overrides: dict[str, str]) -> dict[str, Any]:
    """Set `a.b.c=value` pairs into nested `data`; values are parsed as YAML ('3' -> 3, 'null' -> None)."""
    for dotted, raw in overrides.items():
        value = parse_yaml(raw) if raw != "" else ""
        node: Any = data
        keys = dotted.split(".")
        for key in keys[:-1]:
            if isinstance(node, list):  # a list's item by its index: --trainer.callbacks.0.init_args.path
                node = _item(node, key, dotted)
                continue
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"override --{dotted}: '{key}' is a {type(child).__name__}, not a section")
            node = child
        if isinstance(node, list):
            node[_index(node, keys[-1], dotted)] = value
        else:
            node[keys[-1]] = value
    return data


def _index(items: list[Any], key: str, dotted: str) -> int:
    if not key.isdigit() or int(key) >= len(items):
        raise ConfigError(f"override --{dotted}: '{key}' is not an index of a list of {len(items)} items (0-based)")
    return int(key)


def _item(items: list[Any], key: str, dotted: str) -> Any:
    item = items[_index(items, key, dotted)]
    if not isinstance(item, (dict, list)):
        raise ConfigError(f"override --{dotted}: item {key} is a {type(item).__name__}, not a section")
    return item


def validate_experiment(data: dict[str, Any], source: str = "config") -> ExperimentConfig:
    """Validate a raw mapping into an ExperimentConfig or raise a one-line ConfigError."""
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {explain(exc, ExperimentConfig, data)}") from None


def validate_trainer(kwargs: dict[str, Any]) -> TrainerConfig:
    """Validate Trainer(...) keyword arguments, with the same messages as the YAML path."""
    try:
        config = TrainerConfig.model_validate(kwargs)
    except ValidationError as exc:
        raise ConfigError(f"Trainer(...): {explain(exc, TrainerConfig, kwargs, prefix='')}") from None
    _check_callbacks(config)
    return config


def with_updates(config: TrainerConfig, updates: dict[str, Any]) -> TrainerConfig:
    """`config` with `updates` (options set by mapped callbacks or model.fit's arguments), validated again (a
    ConfigError naming the field), the batch size it adopted from the user's data kept."""
    updated = validate_trainer({**config.model_dump(exclude_unset=True), **updates})
    updated._batch_size_from = config.batch_size_from
    return updated


def check_classes(experiment: ExperimentConfig) -> None:
    """Import every class the experiment names and check its init_args against its __init__, so a
    mistake fails here, in one line, before any process starts (the schema alone cannot see them)."""
    check(experiment.module.class_path, experiment.module.init_args, "module")
    if experiment.data is not None:
        check(experiment.data.class_path, experiment.data.init_args, "data")
    _check_callbacks(experiment.trainer)


def _check_callbacks(config: TrainerConfig) -> None:
    for i, callback in enumerate(config.callbacks):
        check(callback.class_path, callback.init_args, f"trainer.callbacks.{i}")


def explain(exc: ValidationError, model: type[BaseModel], data: Any, prefix: str = "") -> str:
    """Every error pydantic found, each as 'field: received X; fix', in one line (a file's problems all at once;
    one per field: a union's alternatives are not listed one by one)."""
    seen: dict[str, str] = {}
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]]
        field = prefix + ".".join(loc if err["type"] == "extra_forbidden" else _field_path(model, loc))
        seen.setdefault(field, _explain_one(err, model, prefix))
    return "; ".join(seen.values())


def _field_path(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The part of an error's location that names fields (a union member's tag after it is dropped)."""
    for end in range(len(loc), 0, -1):
        parent = _model_at(model, loc[: end - 1])
        if parent is not None and loc[end - 1] in parent.model_fields:
            return loc[:end]
    return loc


def _explain_one(err: Any, model: type[BaseModel], prefix: str) -> str:
    loc, member = _without_union_tag([str(p) for p in err["loc"]])
    field = prefix + ".".join(loc)
    if err["type"] == "extra_forbidden":
        parent = member or _model_at(model, loc[:-1])
        hint = ""
        unifit_name = unifit_form(loc[-1], err.get("input")) if parent is TrainerConfig else None
        if unifit_name is not None:  # Lightning's Trainer argument: its place in the one mapping (lightning_cli.py)
            return f"unknown key '{field}' (Lightning's name; unifit's is {unifit_name}); rename it"
        if parent is not None:
            close = difflib.get_close_matches(loc[-1], list(parent.model_fields), n=1)
            hint = (
                f" (did you mean '{close[0]}'?)"
                if close
                else f"; valid keys: {', '.join(parent.model_fields) or '(none)'}"
            )
        return f"unknown key '{field}'{hint}; remove it or fix its name"
    if err["type"] == "missing":
        return f"'{field}' is required but missing; add it to the config"
    from unifit.storage import redact, redact_secret_names

    received = redact_secret_names(err.get("input"))
    if any(p in ("storage_options", "loggers") for p in loc):
        received = redact(received)
    msg = err["msg"].removeprefix("Value error, ")
    return f"'{field}' received {received!r}: {msg}; fix the value of {field}"


def _without_union_tag(loc: list[str]) -> tuple[list[str], type[BaseModel] | None]:
    """'loggers.0.mlflow.trackin_uri' (pydantic names the union member it chose) as 'loggers.0.trackin_uri', and
    that member's model, for its 'did you mean'."""
    from unifit.config.schema import LOGGER_MODELS

    for i in range(len(loc) - 2):
        if loc[i] == "loggers" and loc[i + 1].isdigit() and loc[i + 2] in LOGGER_MODELS:
            return loc[: i + 2] + loc[i + 3 :], LOGGER_MODELS[loc[i + 2]]
    return loc, None


def _model_at(model: type[BaseModel], loc: list[str]) -> type[BaseModel] | None:
    """Follow field names through nested models (for 'did you mean' hints)."""
    current: Any = model
    for name in loc:
        field = getattr(current, "model_fields", {}).get(name)
        if field is None:
            return None
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        current = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if current is None:
            return None
    return current


def resolved_yaml(config: ExperimentConfig) -> str:
    """The fully resolved config as YAML (what print-config shows and each run saves), secrets redacted."""
    from unifit.storage import redact, redact_secret_names

    data = config.model_dump(mode="json")
    data["trainer"]["storage_options"] = redact(data["trainer"]["storage_options"])
    data["trainer"]["loggers"] = redact(data["trainer"]["loggers"])  # a custom logger's api_key, say
    data = redact_secret_names(data)  # module/data init_args' api_key, hf_token...; URL credentials anywhere
    return yaml.dump(data, Dumper=_Yaml12Dumper, sort_keys=False)
