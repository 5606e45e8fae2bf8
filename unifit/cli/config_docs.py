"""Generate docs/config.md from the schema, so the reference cannot drift from the code.

python -m unifit.cli.config_docs > docs/config.md
"""

from __future__ import annotations

import json
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from unifit.config.schema import (
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
            "| key | type | default | meaning |",
            "|---|---|---|---|",
        ]
        for name, field in model.model_fields.items():
            lines.append(
                f"| `{name}` | `{' '.join([_type_name(field.annotation), *_bounds(field.metadata)])}` | `{_default(field)}` | {field.description or ''} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
