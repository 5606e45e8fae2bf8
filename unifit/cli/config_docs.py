"""Generate docs/config.md from the schema and every registered strategy's options model, so the
reference cannot drift from the code.

python -m unifit.cli.config_docs > docs/config.md
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from unifit.config.schema import (
    ActivationCheckpointingConfig,
    CheckpointConfig,
    CSVLoggerConfig,
    EarlyStoppingConfig,
    ExperimentConfig,
    MLflowLoggerConfig,
    NanGuardConfig,
    PreemptionConfig,
    TensorBoardConfig,
    TrainerConfig,
    WandbLoggerConfig,
)

SECTIONS: list[tuple[str, type[BaseModel]]] = [
    ("(top level)", ExperimentConfig),
    ("trainer", TrainerConfig),
    ("trainer.checkpoint", CheckpointConfig),
    ("trainer.tensorboard", TensorBoardConfig),
    ("trainer.early_stopping", EarlyStoppingConfig),
    ("trainer.nan_guard", NanGuardConfig),
    ("trainer.activation_checkpointing", ActivationCheckpointingConfig),
    ("trainer.preemption", PreemptionConfig),
    ("trainer.loggers: {name: csv}", CSVLoggerConfig),
    ("trainer.loggers: {name: mlflow}", MLflowLoggerConfig),
    ("trainer.loggers: {name: wandb}", WandbLoggerConfig),
]


def _type_name(annotation: Any) -> str:
    """A readable type: 'int > 0 | null', "'min' | 'max'", 'list[ClassPath]'."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return " ".join([_type_name(args[0]), *_bounds(annotation.__metadata__)])
    if origin in (Union, UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: Any) -> list[str]:
    return [
        f"{sym} {getattr(m, attr)}" for m in metadata for attr, sym in (("gt", ">"), ("ge", ">=")) if hasattr(m, attr)
    ]


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        return "see below" if isinstance(value, BaseModel) else json.dumps(value)
    return json.dumps(field.default)


def _source_comments(model: type[BaseModel]) -> dict[str, str]:
    """Field -> the comment at the end of its line in the class body (`name: int = 1  # what it does`),
    for fields whose Field() has no description: the code's own words, read from the code."""
    comments: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        try:
            lines, _ = inspect.getsourcelines(cls)
        except (OSError, TypeError):
            continue
        source = textwrap.dedent("".join(lines))
        for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                line = source.splitlines()[node.end_lineno - 1]  # type: ignore[operator]
                if "#" in line:
                    comments[node.target.id] = line.split("#", 1)[1].strip()
    return comments


def _table(model: type[BaseModel]) -> list[str]:
    comments = _source_comments(model)
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        meaning = (field.description or comments.get(name, "")).replace("|", "\\|")
        lines.append(
            f"| `{name}` | `{' '.join([_type_name(field.annotation), *_bounds(field.metadata)])}` | `{_default(field)}` | {meaning} |"
        )
    return lines


def strategy_sections() -> list[tuple[str, str, type[BaseModel]]]:
    """(strategy name, its frameworks, its options model) for every registered strategy, in registry order."""
    from unifit._imports import load_object
    from unifit.strategies import registry

    frameworks = {"torch": "PyTorch", "tensorflow": "Keras"}
    out = []
    for name in registry.names():
        entry = registry.entry(name)
        cls = load_object(entry.strategy, field="trainer.strategy")
        takes = " and ".join(frameworks[f] for f in sorted(entry.frameworks, reverse=True))
        out.append((name, takes, cls.Options))
    return out


def render() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from `unifit/config/schema.py` by `python -m unifit.cli.config_docs`;",
        "a test fails when this page and the schema differ. Every key can be set in the YAML file,",
        "overridden on the command line (`--trainer.max_epochs 3`), or passed to `Trainer(...)`.",
        "Unknown keys are errors.",
        "",
    ]
    for section, model in SECTIONS:
        lines += [
            f"## `{section}`",
            "",
            " ".join((model.__doc__ or "").split()),
            "",
            *_table(model),
            "",
        ]
    lines += [
        "## `trainer.strategy_options`, per strategy",
        "",
        "Each strategy checks `trainer.strategy_options` against its own options model (below, one section",
        "per registered strategy, generated from that model). Unknown keys are errors.",
        "",
    ]
    for name, takes, options in strategy_sections():
        fields = bool(options.model_fields)
        lines += [
            f"### `{name}`",
            "",
            f"{takes} modules; see [strategies/{name}.md](strategies/{name}.md). "
            + (
                " ".join((options.__doc__ or "").split()) if fields else "No options: `strategy_options` must be empty."
            ),
            "",
        ]
        if fields:
            lines += [*_table(options), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
