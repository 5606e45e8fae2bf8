"""A LightningCLI config file as unifit's experiment: `unifit fit -c config.yaml` where config.yaml is what
`python main.py fit --print_config` writes (sections `model:`, `data:`, `trainer:` with Lightning's Trainer
arguments, `seed_everything`, `ckpt_path`).

Lightning's Trainer arguments map onto unifit's (`max_steps: -1` is no limit, `precision: 16` is 16-mixed,
`enable_checkpointing: false` turns checkpoints off, `callbacks` are Lightning callbacks, ...); an argument at
Lightning's default needs no mapping; one unifit cannot honour is reported with every other problem of the file
in one line. Learning rates are not scaled with the world size (`lr_scaling: none`), as under Lightning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from unifit.config.schema import PRECISION_SPELLINGS, TrainerConfig
from unifit.errors import ConfigError

log = logging.getLogger("unifit")

# the top-level keys only a LightningCLI file has
_CLI_KEYS = ("model", "seed_everything", "ckpt_path", "optimizer", "lr_scheduler", "weights_only")
_STRATEGIES = {
    "auto": None,  # single process, or ddp when the run has several
    "ddp": "ddp",
    "ddp_spawn": "ddp",
    "ddp_fork": "ddp",
    "ddp_notebook": "ddp",
    "ddp_find_unused_parameters_true": "ddp",
    "ddp_find_unused_parameters_false": "ddp",
    "fsdp": "fsdp",
    "single_device": "single",
    "DDPStrategy": "ddp",
    "FSDPStrategy": "fsdp",
    "SingleDeviceStrategy": "single",
}
_ACCELERATORS = {"auto": "auto", "cpu": "cpu", "gpu": "gpu", "cuda": "gpu"}
# Lightning Trainer arguments unifit has no counterpart for, with the values that mean "Lightning's default"
# (any of them is fine), and what to do instead
_DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "min_epochs": ((None, 0), "unifit has no minimum: early stopping may stop any epoch"),
    "min_steps": ((None, 0, -1), "unifit has no minimum: early stopping may stop any epoch"),
    "limit_test_batches": ((None, 1.0), "test the whole set, or pass a smaller test loader"),
    "limit_predict_batches": ((None, 1.0), "predict the whole set, or pass a smaller predict loader"),
    "overfit_batches": ((None, 0, 0.0), "pass a small training set instead"),
    "deterministic": ((None, False), "call torch.use_deterministic_algorithms(True) in the module's setup()"),
    "benchmark": ((None, False, True), ""),
    "profiler": ((None,), "profile with torch.profiler from a callback"),
    "detect_anomaly": ((None, False), "call torch.autograd.set_detect_anomaly(True) in the module's setup()"),
    "barebones": ((None, False), ""),
    "plugins": ((None, []), "unifit's precision and strategy take their place"),
    "sync_batchnorm": ((None, False), "convert the model with torch.nn.SyncBatchNorm.convert_sync_batchnorm"),
    "reload_dataloaders_every_n_epochs": ((None, 0), "unifit builds the loaders once per fit"),
    "use_distributed_sampler": ((None, True), "unifit always shards the data over the ranks"),
    "gradient_clip_algorithm": ((None, "norm"), "clip by value in configure_gradient_clipping"),
    "inference_mode": ((None, True, False), ""),
    "enable_model_summary": ((None, True, False), ""),
    "enable_autolog_hparams": ((None, True, False), ""),  # unifit saves the resolved config with every run
    "model_registry": ((None,), "register the exported model (trainer.export_dir) yourself"),
    "num_sanity_val_steps": ((None, 0, 2, -1), ""),  # unifit checks the config before any step instead
}


@dataclass
class LightningRun:
    """A LightningCLI file as unifit's experiment, and the processes it asks for (checked where they run)."""

    experiment: dict[str, Any]
    devices: Any = "auto"
    num_nodes: int = 1


def is_lightning_cli(data: dict[str, Any]) -> bool:
    return "module" not in data and any(key in data for key in _CLI_KEYS)


def from_lightning_cli(data: dict[str, Any], source: str) -> LightningRun:
    """The experiment the file describes; every problem of the file in one ConfigError."""
    problems: list[str] = []
    experiment: dict[str, Any] = {}
    model = data.get("model")
    if not isinstance(model, dict) or "class_path" not in model:
        problems.append(
            "model: has no class_path (a script's LightningCLI(MyModel) names the class, the file does not): give "
            "model: {class_path: my_package.MyModel, init_args: {...}}"
        )
    else:
        experiment["module"] = _class_path(model)
    if isinstance(data.get("data"), dict):
        experiment["data"] = _class_path(data["data"])
    for key in ("optimizer", "lr_scheduler"):
        if data.get(key) is not None:
            problems.append(
                f"{key}: LightningCLI's auto-configured {key} is not built by unifit; return it from the module's "
                "configure_optimizers()"
            )
    unknown = sorted(set(data) - {"data", "trainer", *_CLI_KEYS})
    problems += [f"{key}: not a LightningCLI section unifit knows; remove it" for key in unknown]
    trainer, devices, num_nodes = _trainer(dict(data.get("trainer") or {}), problems)
    seed = data.get("seed_everything")
    if seed is True:
        problems.append("seed_everything: true draws a random seed; give the seed (an integer) so every rank agrees")
    elif seed not in (None, False):
        trainer["seed"] = seed
    if data.get("ckpt_path"):
        trainer["resume"] = data["ckpt_path"]
    if problems:
        raise ConfigError(f"{source} (a LightningCLI file): " + "; ".join(problems))
    experiment["trainer"] = trainer
    return LightningRun(experiment, devices, num_nodes)


def _class_path(section: dict[str, Any]) -> dict[str, Any]:
    return {"class_path": section["class_path"], "init_args": dict(section.get("init_args") or {})}


def _trainer(lightning: dict[str, Any], problems: list[str]) -> tuple[dict[str, Any], Any, int]:
    """unifit's trainer section from Lightning's Trainer arguments (unifit's own keys pass as they are)."""
    out: dict[str, Any] = {"lr_scaling": "none"}
    devices, num_nodes = _processes(lightning, problems)
    _map_arguments(lightning, out, problems, "trainer.")
    if "max_epochs" not in out and "max_steps" not in out:
        out["max_epochs"] = 1000  # Lightning's when neither is given
    processes = _count(devices, problems) * int(num_nodes)
    if out.get("strategy", "auto") == "auto":
        out["strategy"] = "ddp" if processes > 1 else "single"
    return out, devices, int(num_nodes)


def _processes(lightning: dict[str, Any], problems: list[str]) -> tuple[Any, int]:
    """Lightning's `devices` and `num_nodes` (taken out of `lightning`): the processes the run asks for."""
    devices, num_nodes = lightning.pop("devices", "auto"), lightning.pop("num_nodes", 1) or 1
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        problems.append(f"trainer.num_nodes: received {num_nodes!r}; give the number of nodes (1 or more)")
        num_nodes = 1
    return devices, num_nodes


def _map_arguments(lightning: dict[str, Any], out: dict[str, Any], problems: list[str], prefix: str) -> None:
    """Each Lightning Trainer argument into `out` through _MAPPERS; what unifit cannot honour into `problems`."""
    for key, value in lightning.items():
        try:
            if key in _MAPPERS:
                _MAPPERS[key](value, out)
            elif key in _DEFAULT_ONLY:
                defaults, instead = _DEFAULT_ONLY[key]
                if value not in defaults:
                    raise ConfigError(
                        f"received {value!r}, which unifit does not offer" + (f": {instead}" if instead else "")
                    )
            elif key in TrainerConfig.model_fields:
                out[key] = value  # a unifit option in the same section
            else:
                raise ConfigError("not a Lightning Trainer argument unifit knows; remove it")
        except ConfigError as exc:
            problems.append(f"{prefix}{key}: {exc}")
        except (TypeError, ValueError):  # int("ten")
            problems.append(f"{prefix}{key}: received {value!r}; give a number")


def _count(devices: Any, problems: list[str]) -> int:
    if devices in ("auto", -1, "-1", None):
        return 1
    if isinstance(devices, int) or (isinstance(devices, str) and devices.isdigit()):
        return int(devices)
    problems.append(
        f"trainer.devices: received {devices!r}; give a number of processes per node (the GPUs are the local ranks')"
    )
    return 1


def from_lightning_keywords(
    kwargs: dict[str, Any], launched: bool
) -> tuple[dict[str, Any], list[Any], LightningRun | None]:
    """`unifit.Trainer(...)`'s keywords where a script written for Lightning's Trainer gives Lightning's arguments:
    those (and Lightning's spellings of unifit's own, `precision=16`, `max_epochs=-1`, `strategy="auto"`) mapped
    through the same table as a LightningCLI file's; everything unifit cannot honour in one ConfigError. Returns
    TrainerConfig's keywords, the logger objects of `logger=`, and the processes asked for (`devices`,
    `num_nodes`; None when neither is given). `launched`: started by unifit launch, whose --strategy then stands for Lightning's "auto"."""
    lightning = {key: value for key, value in kwargs.items() if _lightning_spelling(key, value)}
    asks = "devices" in lightning or "num_nodes" in lightning
    out = {key: value for key, value in kwargs.items() if key not in lightning}
    problems: list[str] = []
    devices, num_nodes = _processes(lightning, problems)
    if "logger" in lightning and "loggers" in out:
        problems.append("logger and loggers: give the loggers one way (logger= is Lightning's, loggers= unifit's)")
    objects = _logger_objects(lightning)
    mapped: dict[str, Any] = {}
    _map_arguments(lightning, mapped, problems, "")
    if mapped.get("strategy") == "auto":
        del mapped["strategy"]  # one process, or the launch's strategy
    if (
        "strategy" not in mapped
        and "strategy" not in out
        and not launched
        and _count(devices, problems) * num_nodes > 1
    ):
        mapped["strategy"] = "ddp"  # Lightning's "auto" with several processes
    for key, value in mapped.items():
        if key in out and isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = {**out[key], **value}  # e.g. log_every_n_steps beside tensorboard={...}
        elif key in out and out[key] != value and key != "loggers":
            problems.append(f"{key}: given as {out[key]!r} and, by Lightning's argument, as {value!r}; give one")
        else:
            out[key] = value
    if problems:
        raise ConfigError("Trainer(...) (Lightning's Trainer arguments): " + "; ".join(problems))
    return out, objects, LightningRun({}, devices, num_nodes) if asks else None


def _lightning_spelling(key: str, value: Any) -> bool:
    """Whether Trainer(key=value) goes through Lightning's mapping: every name in it (Lightning's spellings of
    unifit's own, precision=16, max_epochs=-1, limit_train_batches=1.0, mean what they mean in Lightning's), but
    `callbacks` and a strategy that is not Lightning's name."""
    if key in ("devices", "num_nodes") or key in _DEFAULT_ONLY:
        return True
    if key not in _MAPPERS or key == "callbacks":  # callback objects are the Trainer's to sort
        return False
    if key == "strategy":  # unifit's own names and Strategy class paths stay unifit's
        return isinstance(value, str) and value in _STRATEGIES
    return True


def _logger_objects(lightning: dict[str, Any]) -> list[Any]:
    """The logger objects of Lightning's `logger=` (taken out; its {class_path} entries and True/False stay)."""
    value = lightning.get("logger")
    entries = value if isinstance(value, list) else [value]
    objects = [entry for entry in entries if entry is not None and not isinstance(entry, (bool, dict))]
    if objects:
        lightning["logger"] = [entry for entry in entries if isinstance(entry, dict)]  # [] : the objects alone
    return objects


def unifit_form(key: str, value: Any) -> str | None:
    """unifit's option for Lightning's Trainer argument `key` given `value` (the dotted names its mapping sets), for
    the hint where a unifit experiment file uses Lightning's name; None when the mapping has none."""
    if key in ("devices", "num_nodes"):
        return f"the launch's: unifit launch --{'nproc-per-node' if key == 'devices' else 'nnodes'} N"
    if key not in _MAPPERS:
        return None
    out: dict[str, Any] = {}
    try:
        _MAPPERS[key](value, out)
    except (ConfigError, TypeError, ValueError):
        return None
    return ", ".join(_dotted(out)) or None


def _dotted(tree: dict[str, Any], prefix: str = "") -> list[str]:
    return [
        name
        for key, value in tree.items()
        for name in (_dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])
    ]


def check_processes(
    run: LightningRun, local_world_size: int, world_size: int, source: str, start: str | None = None
) -> None:
    """The file's `devices` and `num_nodes` against the processes this run has (in a training process); `start`:
    what follows the launch's flags in the hint (`-c FILE` by default)."""
    devices = run.devices
    expected = local_world_size if devices in ("auto", -1, "-1", None) else int(devices)
    if (expected, run.num_nodes) != (local_world_size, max(1, world_size // max(1, local_world_size))):
        raise ConfigError(
            f"{source}: trainer.devices {devices!r} and num_nodes {run.num_nodes} ask for {expected} processes on "
            f"each of {run.num_nodes} nodes, this run has {local_world_size} per node and {world_size} in all; start "
            f"it with unifit launch --nproc-per-node {expected} --nnodes {run.num_nodes} {start or f'-c {source}'}"
        )


# ---- Lightning's Trainer arguments that map onto unifit's --------------------------------------------
def _set(name: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[Any, dict[str, Any]], None]:
    def mapper(value: Any, out: dict[str, Any]) -> None:
        converted = convert(value)
        if converted is not None:
            out[name] = converted

    return mapper


def _section(section: str, name: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[..., None]:
    def mapper(value: Any, out: dict[str, Any]) -> None:
        converted = convert(value)
        if converted is not None:
            out.setdefault(section, {})[name] = converted

    return mapper


def _strategy_into(value: Any, out: dict[str, Any]) -> None:
    """Lightning's strategy; a ModelParallelStrategy's sizes become model-parallel's options, an FSDPStrategy's
    activation_checkpointing_policy (block classes) trainer.activation_checkpointing."""
    name = value.get("class_path", "").rsplit(".", 1)[-1] if isinstance(value, dict) else str(value)
    if name == "FSDPStrategy" and isinstance(value, dict) and value.get("init_args"):
        args = dict(value["init_args"])
        policy = args.pop("activation_checkpointing_policy", None) or args.pop("activation_checkpointing", None)
        if policy:
            classes = [str(c).rsplit(".", 1)[-1] for c in (policy if isinstance(policy, (list, tuple)) else [policy])]
            out["activation_checkpointing"] = {"mode": "full", "blocks": classes}
        value = {**value, "init_args": args}
    if name != "ModelParallelStrategy":
        out["strategy"] = _strategy(value)
        return
    args = dict(value.get("init_args") or {}) if isinstance(value, dict) else {}
    tensor, data = args.pop("tensor_parallel_size", "auto"), args.pop("data_parallel_size", "auto")
    backend = args.pop("process_group_backend", None)
    if args.pop("save_distributed_checkpoint", True) is not True:
        log.info(
            "ModelParallelStrategy save_distributed_checkpoint: false: unifit's checkpoints stay sharded (resumable "
            "on any layout, or in one process); the whole model is written at the end to trainer.export_dir"
        )
    if args:
        raise ConfigError(f"ModelParallelStrategy init_args {sorted(args)}: not mapped by unifit; remove them")
    options: dict[str, Any] = {"tensor_parallel": tensor, "data_parallel": data}
    if backend is not None:
        options["backend"] = backend
    out["strategy"], out["strategy_options"] = "model-parallel", options


def _strategy(value: Any) -> str | None:
    """Lightning's names and classes mapped; any other name is taken as unifit's own (single, smddp-like,
    horovod...), which the strategy registry checks with the other options."""
    name = value.get("class_path", "").rsplit(".", 1)[-1] if isinstance(value, dict) else str(value)
    if isinstance(value, dict) and value.get("init_args"):
        raise ConfigError(f"{name} with init_args {value['init_args']}: give the strategy by name (ddp, fsdp)")
    if name in _STRATEGIES:
        return _STRATEGIES[name] or "auto"
    if name.lower().startswith(("deepspeed", "xla", "fsdp_cpu_offload", "ddp_sharded")) or name.endswith("Strategy"):
        raise ConfigError(
            f"received {name!r}, which unifit does not run; use auto, ddp (and its spawn/fork forms), fsdp or "
            "single_device (DeepSpeed's sharding: fsdp), or unifit's own names (smddp-like, horovod)"
        )
    return name


def _precision(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value)
    if text not in PRECISION_SPELLINGS:
        raise ConfigError(f"received {value!r}; unifit trains in 32-true, 16-mixed and bf16-mixed")
    return PRECISION_SPELLINGS[text]


def _accelerator(value: Any) -> str | None:
    if value is None:
        return None
    if str(value) not in _ACCELERATORS:
        raise ConfigError(f"received {value!r}; use auto, cpu or gpu")
    return _ACCELERATORS[str(value)]


def _max_epochs(value: Any) -> int | None:
    return None if value in (None, -1) else int(value)


def _max_steps(value: Any) -> int | None:
    return None if value in (None, -1) else int(value)


def _whole_or_count(name: str) -> Callable[[Any], int | None]:
    """Lightning's limit_*_batches: an int count, or a fraction where 1.0 is all (other fractions refused)."""

    def convert(value: Any) -> int | None:
        if value is None or (isinstance(value, float) and value == 1.0):
            return None
        if isinstance(value, int) or value == 0.0:
            return int(value)
        raise ConfigError(f"received {value!r}; give a number of batches (an integer), or 1.0 for all")

    return convert


def _clip(value: Any) -> float | None:
    return None if not value else float(value)


def _max_time(value: Any) -> Any:
    if isinstance(value, dict):
        seconds = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
        unknown = sorted(set(value) - set(seconds))
        if unknown or not all(isinstance(v, (int, float)) for v in value.values()):
            raise ConfigError(f"received {value!r}; give numbers of {', '.join(seconds)}, or 'DD:HH:MM:SS'")
        return float(sum(seconds[k] * v for k, v in value.items()))
    return value


# Lightning's loggers as unifit's: {Lightning init arg: unifit option} (None: accepted, nothing to map)
_LOGGER_ARGS: dict[str, tuple[str, dict[str, str | None]]] = {
    "TensorBoardLogger": ("tensorboard", {"save_dir": None, "name": None, "version": None, "log_graph": None}),
    "CSVLogger": ("csv", {"save_dir": "path", "name": None, "version": None, "flush_logs_every_n_steps": None}),
    "MLFlowLogger": (
        "mlflow",
        {
            "experiment_name": "experiment",
            "run_name": "run_name",
            "tracking_uri": "tracking_uri",
            "tags": "tags",
            "log_model": "log_checkpoints",
            "save_dir": None,
            "prefix": None,
            "synchronous": None,
        },
    ),
    "WandbLogger": (
        "wandb",
        {
            "name": "run_name",
            "project": "project",
            "entity": "entity",
            "group": "group",
            "tags": "tags",
            "save_dir": "dir",
            "dir": "dir",
            "offline": "mode",
            "mode": "mode",
            "log_model": "log_checkpoints",
            "prefix": None,
        },
    ),
}


def _logger(value: Any, out: dict[str, Any]) -> None:
    """Lightning's TensorBoardLogger, CSVLogger, MLFlowLogger and WandbLogger as unifit's loggers (their arguments
    mapped); one with an argument unifit's has not, and any other Lightning logger, runs as it is, by class path."""
    if value is False:
        out.setdefault("tensorboard", {})["enabled"] = False
        out["loggers"] = []
        return
    if value in (None, True):
        return
    loggers: list[Any] = []
    for entry in value if isinstance(value, list) else [value]:
        if not isinstance(entry, dict) or "class_path" not in entry:
            raise ConfigError(f"received {entry!r}; give each logger as {{class_path: ..., init_args: {{...}}}}")
        kind = entry["class_path"].rsplit(".", 1)[-1]
        args = dict(entry.get("init_args") or {})
        if kind not in _LOGGER_ARGS:
            loggers.append(_class_path(entry))
            continue
        name, mapping = _LOGGER_ARGS[kind]
        unknown = sorted(set(args) - set(mapping))
        if unknown:  # Lightning's own logger then, driven as Lightning's Trainer drives it
            log.info("trainer.logger: %s runs as Lightning's own (unifit's %s logger has no %s)", kind, name, unknown)
            loggers.append(_class_path(entry))
            continue
        spec: dict[str, Any] = {"name": name}
        for arg, option in mapping.items():
            if option is not None and args.get(arg) is not None:
                spec[option] = args[arg]
        if name == "tensorboard" and args.get("save_dir"):
            out.setdefault("tensorboard", {})["log_dir"] = str(args["save_dir"])
        if name == "csv" and "path" in spec:
            spec["path"] = f"{str(spec['path']).rstrip('/')}/metrics.csv"
        if name == "mlflow":
            spec["log_checkpoints"] = bool(spec.get("log_checkpoints"))
            if "tracking_uri" not in spec:  # Lightning's: a file store in save_dir (./mlruns)
                spec["tracking_uri"] = f"file:{args.get('save_dir') or './mlruns'}"
        if name == "wandb":
            spec["log_checkpoints"] = bool(spec.get("log_checkpoints"))
            if isinstance(spec.get("mode"), bool):  # offline: true / false
                spec["mode"] = "offline" if spec["mode"] else "online"
        loggers.append(spec)
    out["loggers"] = loggers


def _callbacks(value: Any, out: dict[str, Any]) -> None:
    if value is None:
        return
    entries = value if isinstance(value, list) else [value]
    for entry in entries:
        if not isinstance(entry, dict) or "class_path" not in entry:
            raise ConfigError(f"received {entry!r}; give each callback as {{class_path: ..., init_args: {{...}}}}")
    out["callbacks"] = [_class_path(entry) for entry in entries]


def _fast_dev_run(value: Any, out: dict[str, Any]) -> None:
    """Lightning's quick check: n (True: 1) training and validation batches, one epoch, no checkpoints or logs."""
    if value in (None, False, 0):
        return
    n = 1 if value is True else int(value)
    out.update(max_epochs=1, max_steps=n, limit_train_batches=n, limit_val_batches=n)
    out["checkpoint"] = {"enabled": False}
    out["tensorboard"] = {"enabled": False}


def _enable(section: str, key: str = "enabled") -> Callable[[Any, dict[str, Any]], None]:
    def mapper(value: Any, out: dict[str, Any]) -> None:
        if value is not None:
            if section == "progress_bar":
                out["progress_bar"] = bool(value)
            else:
                out.setdefault(section, {})[key] = bool(value)

    return mapper


_MAPPERS: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "accelerator": _set("accelerator", _accelerator),
    "strategy": _strategy_into,
    "precision": _set("precision", _precision),
    "logger": _logger,
    "callbacks": _callbacks,
    "max_epochs": _set("max_epochs", _max_epochs),
    "max_steps": _set("max_steps", _max_steps),
    "max_time": _set("max_time", _max_time),
    "limit_train_batches": _set("limit_train_batches", _whole_or_count("limit_train_batches")),
    "limit_val_batches": _set("limit_val_batches", _whole_or_count("limit_val_batches")),
    "val_check_interval": _set("val_check_interval"),
    "check_val_every_n_epoch": _set("validate_every_n_epochs"),
    "log_every_n_steps": _section("tensorboard", "log_every_n_steps"),
    "enable_checkpointing": _enable("checkpoint"),
    "enable_progress_bar": _enable("progress_bar"),
    "accumulate_grad_batches": _set("accumulate_grad_batches"),
    "gradient_clip_val": _set("gradient_clip_val", _clip),
    "default_root_dir": _set("root_dir", lambda v: None if v is None else str(v)),
    "fast_dev_run": _fast_dev_run,
}
