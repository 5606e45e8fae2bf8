"""Check `init_args` against the class's `__init__` type hints, and build nested `{class_path, init_args}`.

An experiment names classes (`module`, `data`, `trainer.callbacks`) with their keyword arguments.
`check` runs before any process starts, so a typo or a wrong type fails in one line naming the field
(`module.init_args.hidden`), not later inside one rank. `build` makes the instance in each rank;
a nested `{class_path: ..., init_args: ...}` value is built into an instance first (as LightningCLI
does), e.g. `backbone: {class_path: torch.nn.Linear, init_args: {in_features: 4, out_features: 2}}`.

pydantic does the type checking: the signature becomes a TypedDict (a parameter without a hint
accepts anything, `**kwargs` accepts extra names), so a YAML string like '1e-3' still becomes a float.
"""

from __future__ import annotations

import difflib
import inspect
import types
from typing import Any, Union, get_args, get_origin

from pydantic import ConfigDict, PydanticSchemaGenerationError, PydanticUserError, TypeAdapter, ValidationError
from typing_extensions import NotRequired, Required, TypedDict

from unifit._imports import load_object
from unifit.config.schema import ClassPath
from unifit.config.source_signature import signature_from_source
from unifit.errors import ConfigError


def check(class_path: str, init_args: dict[str, Any], field: str) -> None:
    """Validate `init_args` (nested class paths too) without building anything: from the class's source file where
    that is certain (source_signature.py: the launching process need not import the user's framework), else by
    importing `class_path`. A refusal always comes from the import's check, in its words."""
    if not _has_class_path(list(init_args.values())) and _fits_from_source(class_path, init_args, field):
        return
    _arguments(class_path, init_args, field, make=False)


def _fits_from_source(class_path: str, init_args: dict[str, Any], field: str) -> bool:
    found = signature_from_source(class_path)
    if found is None:
        return False
    name, signature = found
    params = {n: p for n, p in signature.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    extra_allowed = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    hints = {n: p.annotation for n, p in params.items()}
    try:
        _validate(types.SimpleNamespace(__qualname__=name), params, hints, dict(init_args), extra_allowed, field)
    except ConfigError:
        return False  # the import's check says what is wrong
    return True


def build(class_path: str, init_args: dict[str, Any], field: str) -> Any:
    """The instance, built from validated arguments (nested class paths built first)."""
    cls, kwargs = _arguments(class_path, init_args, field, make=True)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # the class's own checks, e.g. a negative size
        raise ConfigError(
            f"{field}.init_args: {_name(cls)}({', '.join(kwargs)}) failed: {exc}; "
            f"fix {field}.init_args to match {_name(cls)}.__init__"
        ) from None


def _arguments(class_path: str, init_args: dict[str, Any], field: str, make: bool) -> tuple[Any, dict[str, Any]]:
    """The class and its validated keyword arguments; `field` is where the class sits, e.g. 'module'."""
    cls = _load(class_path, field)
    try:
        signature = inspect.signature(cls, eval_str=True)
    except NameError:  # a hint naming what only a type checker imports: check names, not types
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read (some builtins): pass the arguments as given
        return cls, dict(init_args)
    params = {
        name: p for name, p in signature.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    hints = {name: p.annotation for name, p in params.items()}
    extra_allowed = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    values = dict(init_args)
    for name, value in init_args.items():
        if _has_class_path(value) and (name in params or extra_allowed):
            where = f"{field}.init_args.{name}"
            hint = hints.get(name, inspect.Parameter.empty)
            values[name] = _nested(value, hint, where, make)
            if not make:  # the class was checked against the hint; nothing was built to validate
                hints[name] = Any
    return cls, _validate(cls, params, hints, values, extra_allowed, field)


def _load(class_path: str, field: str) -> Any:
    try:
        return load_object(class_path, field=f"{field}.class_path")
    except ConfigError as exc:  # load_object says what is wrong; add the fix where it does not
        message = str(exc)
        raise ConfigError(message if "fix" in message else f"{message}; fix {field}.class_path") from None


def _has_class_path(value: Any) -> bool:
    if isinstance(value, list):
        return any(_has_class_path(v) for v in value)
    return isinstance(value, dict) and "class_path" in value


def _nested(value: Any, hint: Any, where: str, make: bool) -> Any:
    """Build (or only check) a nested `{class_path, init_args}`, or each one in a list."""
    if isinstance(value, list):
        return [
            _nested(v, _item_hint(hint), f"{where}.{i}", make) if _has_class_path(v) else v for i, v in enumerate(value)
        ]
    try:
        spec = ClassPath.model_validate(value)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        key = ".".join(str(p) for p in err["loc"])
        raise ConfigError(
            f"'{where}.{key}' received {err.get('input')!r}: {err['msg']}; "
            f"a nested object is {{class_path: ..., init_args: {{...}}}}"
        ) from None
    if not make:
        cls = _load(spec.class_path, where)
        if not _fits(cls, hint):
            raise ConfigError(
                f"'{where}.class_path' received '{spec.class_path}', which is not a "
                f"{_hint_name(hint)}; give the class path of a {_hint_name(hint)}"
            )
        check(spec.class_path, spec.init_args, where)
        return value
    return build(spec.class_path, spec.init_args, where)


def _fits(cls: Any, hint: Any) -> bool:
    """Whether an instance of `cls` may go where `hint` is expected; only plain classes are checked here,
    anything else (a generic, a protocol) is checked once the instance is built."""
    options = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    return not isinstance(cls, type) or any(
        o is Any or o is inspect.Parameter.empty or not isinstance(o, type) or issubclass(cls, o) for o in options
    )


def _item_hint(hint: Any) -> Any:
    """`list[X]` (or Sequence[X], ...) -> X: what each built item of a list must be."""
    args = get_args(hint)
    return args[0] if get_origin(hint) is not None and len(args) == 1 else Any


def _validate(
    cls: Any,
    params: dict[str, inspect.Parameter],
    hints: dict[str, Any],
    values: dict[str, Any],
    extra_allowed: bool,
    field: str,
) -> dict[str, Any]:
    """pydantic checks `values` against the signature; its first error becomes a one-line ConfigError."""
    try:
        adapter = _adapter(cls, params, hints, extra_allowed)
    except (PydanticSchemaGenerationError, PydanticUserError, TypeError):  # a hint pydantic cannot check
        adapter = _adapter(cls, params, {name: Any for name in hints}, extra_allowed)
    try:
        return adapter.validate_python(values)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, cls, params, hints, field)) from None


def _explain(exc: ValidationError, cls: Any, params: dict[str, Any], hints: dict[str, Any], field: str) -> str:
    """pydantic's first error as 'field: received X; fix', the field named as in the YAML; an unknown
    name first, since it is often a misspelled required one."""
    errors = exc.errors(include_url=False)
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    name = str(err["loc"][0]) if err["loc"] else ""
    where = ".".join([f"{field}.init_args", *(str(p) for p in err["loc"])])
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(name, list(params), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        accepted = ", ".join(params) or "(none)"
        return (
            f"unknown argument '{where}'{hint} (received {err.get('input')!r}); {_name(cls)} accepts: "
            f"{accepted}; remove it or fix its name"
        )
    if err["type"] == "missing":
        return f"'{where}' is required by {_name(cls)} but missing; add it to {field}.init_args"
    expected = _hint_name(hints.get(name, Any))
    return (
        f"'{where}' received {err.get('input')!r}: {err['msg']}; "
        f"give a value of type {expected} ({_name(cls)}.__init__)"
    )


def _adapter(cls: Any, params: dict[str, inspect.Parameter], hints: dict[str, Any], extra_allowed: bool) -> TypeAdapter:
    """A TypedDict of the keyword parameters: keys may be any name, and what it returns is the kwargs."""
    fields = {}
    for name, p in params.items():
        hint = hints[name]
        hint = Any if hint is inspect.Parameter.empty or isinstance(hint, str) else hint
        fields[name] = Required[hint] if p.default is inspect.Parameter.empty else NotRequired[hint]
    arguments = TypedDict(f"{_name(cls)}Arguments", fields)  # type: ignore[operator]
    arguments.__pydantic_config__ = ConfigDict(  # type: ignore[attr-defined]
        extra="allow" if extra_allowed else "forbid", arbitrary_types_allowed=True
    )
    return TypeAdapter(arguments)


def _name(cls: Any) -> str:
    return getattr(cls, "__qualname__", None) or type(cls).__name__


def _hint_name(hint: Any) -> str:
    if hint is inspect.Parameter.empty or hint is Any:
        return "any type"
    if isinstance(hint, type):
        return hint.__name__ if hint.__module__ == "builtins" else f"{hint.__module__}.{hint.__qualname__}"
    return str(hint).replace("typing.", "")
