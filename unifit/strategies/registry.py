"""Strategy names -> where they live, which frameworks they run, and how they are launched.

One table keyed by (strategy, framework): each row names the framework-neutral Strategy class, its
launcher, and per framework the training part that does what differs (wrapping the model, reducing
gradients), or ITSELF where the strategy is built on that one framework's own library (ddp, fsdp on
torch.distributed; mirrored, mwms on tf.distribute). Entries are dotted paths so torch, TensorFlow and
Horovod are imported only when the strategy is used. Adding a strategy means one file beside this one
and its row here; a strategy of your own needs neither: name its class path
(`trainer.strategy: pkg.module:MyStrategy`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from unifit._imports import load_object
from unifit.errors import ConfigError

if TYPE_CHECKING:
    from unifit.strategies.base import Strategy
    from unifit.strategies.environment import ClusterEnvironment
    from unifit.strategies.launchers.base import Launcher


TORCH, TENSORFLOW = "torch", "tensorflow"
ITSELF = None  # the strategy class is itself that framework's training part (one framework, its own library)


@dataclass(frozen=True)
class StrategyEntry:
    """One row of the (strategy, framework) table: where the strategy lives, how its processes start,
    and for each framework it trains, its training part."""

    name: str
    strategy: str  # dotted path of the Strategy class (framework-neutral: rank facts, collectives, IO)
    launcher: str  # dotted path of the Launcher class that starts its processes
    trainings: Mapping[str, str | None]  # framework -> dotted path of its training part, or ITSELF
    summary: str

    @property
    def frameworks(self) -> frozenset[str]:
        """The module frameworks it can train."""
        return frozenset(self.trainings)


_REGISTRY: dict[str, StrategyEntry] = {}


def register(entry: StrategyEntry) -> None:
    _REGISTRY[entry.name] = entry


_TORCHRUN = "unifit.strategies.launchers.torchrun:TorchrunLauncher"
_ONE_PROCESS = "unifit.strategies.launchers.base:SingleProcessLauncher"
_PLAIN = {
    TORCH: "unifit.strategies.torch_training:TorchTraining",
    TENSORFLOW: "unifit.strategies.keras_training:KerasTraining",
}

register(
    StrategyEntry("single", "unifit.strategies.single:SingleStrategy", _ONE_PROCESS, _PLAIN, "one process, one device")
)
register(
    StrategyEntry(
        "ddp",
        "unifit.strategies.ddp:DDPStrategy",
        _TORCHRUN,
        {TORCH: ITSELF},
        "PyTorch DistributedDataParallel, launched by torchrun",
    )
)
register(
    StrategyEntry(
        "smddp-like",
        "unifit.strategies.smddp:SMDDPLikeStrategy",
        _TORCHRUN,
        {TORCH: ITSELF},
        "DDP with SageMaker-style hierarchical allreduce (the real smddp where installed)",
    )
)
register(
    StrategyEntry(
        "fsdp",
        "unifit.strategies.fsdp:FSDPStrategy",
        _TORCHRUN,
        {TORCH: ITSELF},
        "PyTorch FSDP2: parameters, gradients and optimizer state sharded over the ranks",
    )
)
register(
    StrategyEntry(
        "model-parallel",
        "unifit.strategies.model_parallel:ModelParallelStrategy",
        _TORCHRUN,
        {TORCH: ITSELF},
        "tensor parallelism inside groups of ranks, FSDP2 over the groups (one DeviceMesh)",
    )
)
register(
    StrategyEntry(
        "horovod",
        "unifit.strategies.horovod.strategy:HorovodStrategy",
        "unifit.strategies.launchers.horovodrun:HorovodrunLauncher",
        {
            TORCH: "unifit.strategies.horovod.torch_adapter:TorchHorovod",
            TENSORFLOW: "unifit.strategies.horovod.tf_adapter:TFHorovod",
        },
        "Horovod ring-allreduce, launched by horovodrun",
    )
)
register(
    StrategyEntry(
        "mirrored",
        "unifit.strategies.tf_distribute:MirroredStrategy",
        _ONE_PROCESS,
        {TENSORFLOW: ITSELF},
        "TensorFlow MirroredStrategy: one process, all local devices",
    )
)
register(
    StrategyEntry(
        "mwms",
        "unifit.strategies.tf_distribute:MWMSStrategy",
        "unifit.strategies.launchers.tf_config:TFConfigLauncher",
        {TENSORFLOW: ITSELF},
        "TensorFlow MultiWorkerMirroredStrategy: one process per worker (TF_CONFIG)",
    )
)


register(
    StrategyEntry(
        "parameter-server",
        "unifit.strategies.parameter_server:ParameterServerStrategy",
        "unifit.strategies.launchers.parameter_servers:ParameterServerLauncher",
        {TENSORFLOW: ITSELF},
        "TensorFlow ParameterServerStrategy: workers update variables on parameter servers asynchronously",
    )
)


def names() -> list[str]:
    return list(_REGISTRY)


def entry(name: str) -> StrategyEntry:
    """The registered strategy `name`, or one made from a Strategy subclass's class path
    (`pkg.module:MyStrategy`), imported now: user code is importable by the time a Trainer is made."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "." not in name and ":" not in name:
        raise ConfigError(
            f"trainer.strategy: unknown strategy '{name}'{_did_you_mean(name)}; valid strategies: "
            f"{', '.join(_REGISTRY)}, or the class path of a Strategy subclass (pkg.module:MyStrategy)"
        )
    return _entry_of_class(name)


# Other trainers' names for what a registered strategy does (Lightning's strategy names, tf.distribute's classes)
_THEIR_NAMES = {
    "auto": "single (one process) or ddp (with unifit launch --nproc-per-node N)",
    "ddp_spawn": "ddp",
    "ddp_notebook": "ddp",
    "ddp_find_unused_parameters_true": "ddp with strategy_options {find_unused_parameters: true}",
    "deepspeed": "fsdp (ZeRO-3-style sharding of parameters, gradients and optimizer state)",
    "fsdp2": "fsdp",
    "modelparallelstrategy": "model-parallel",
    "mirroredstrategy": "mirrored",
    "multiworkermirroredstrategy": "mwms",
    "multi_worker_mirrored": "mwms",
    "parameterserverstrategy": "parameter-server",
    "hvd": "horovod",
    "smddp": "smddp-like",
}


def _did_you_mean(name: str) -> str:
    """' (did you mean X?)' for a misspelt or another library's strategy name, else ''."""
    key = name.strip().lower()
    if key in _THEIR_NAMES:
        return f" (did you mean {_THEIR_NAMES[key]}?)"
    spelt = key.replace("_", "-").replace(" ", "-")
    if spelt in _REGISTRY:
        return f" (did you mean '{spelt}'?)"
    close = difflib.get_close_matches(spelt, list(_REGISTRY), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def strategy_class(name: str) -> type[Strategy]:
    """The Strategy class of `name` (imported now; its Options check an experiment before launch)."""
    cls: type[Strategy] = load_object(entry(name).strategy, field="trainer.strategy")
    return cls


def _entry_of_class(path: str) -> StrategyEntry:
    """A user's Strategy subclass: its launcher and trainings from its class attributes, else from the
    registered strategy it extends; a class that is itself a training part trains that framework."""
    from unifit.strategies.base import Strategy
    from unifit.strategies.keras_training import KerasTraining
    from unifit.strategies.torch_training import TorchTraining

    cls = load_object(path, field="trainer.strategy")
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(
            f"trainer.strategy: '{path}' is {cls!r}, not a subclass of unifit.strategies.Strategy; "
            "name a registered strategy or your Strategy subclass"
        )
    extends = next((e for e in _REGISTRY.values() for base in cls.__mro__ if e.strategy == _path_of(base)), None)
    trainings: dict[str, str | None] = dict(extends.trainings) if extends else {}
    trainings.update(cls.trainings)
    for framework, part in ((TORCH, TorchTraining), (TENSORFLOW, KerasTraining)):
        if issubclass(cls, part):
            trainings[framework] = ITSELF
    if not trainings:
        raise ConfigError(
            f"trainer.strategy: {cls.__name__} trains no framework; set its `trainings` (framework -> training part "
            "class path, e.g. {'torch': 'unifit.strategies.torch_training:TorchTraining'}) or extend a registered "
            "strategy (e.g. unifit.strategies.ddp:DDPStrategy)"
        )
    launcher = cls.__dict__.get("launcher") or (extends.launcher if extends else cls.launcher)
    return StrategyEntry(path, path, launcher, trainings, (cls.__doc__ or path).strip().splitlines()[0])


def _path_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def create(name: str, env: ClusterEnvironment, **kwargs: Any) -> Strategy:
    return strategy_class(name)(env, **kwargs)


def training(name: str, framework: str, strategy: Strategy) -> Any:
    """The part of strategy `name` that trains `framework`'s modules (a TorchTraining or KerasTraining),
    bound to `strategy`: the strategy itself where it is one, else made from the table and attached."""
    part = entry(name).trainings[framework]
    if part is ITSELF:
        return strategy
    made = load_object(part, field="trainer.strategy")(strategy)
    strategy.attach(made)
    return made


def claim_process(name: str, env: ClusterEnvironment, **kwargs: object) -> None:
    """What strategy `name` must set up before its framework's first operation in this process (when
    the Trainer is made); strategies that need nothing are not even created."""
    from unifit.strategies.base import Strategy

    cls = load_object(entry(name).strategy, field="trainer.strategy")
    if cls.claim_process is not Strategy.claim_process:
        cls(env, **kwargs).claim_process()


def launcher(name: str) -> Launcher:
    return load_object(entry(name).launcher, field="trainer.strategy")(name)


def check_framework(name: str, framework: str, module_name: str) -> None:
    """Refuse a module the strategy cannot train, naming the strategies that can."""
    found = entry(name)
    if framework in found.frameworks:
        return
    fits = [e.name for e in _REGISTRY.values() if framework in e.frameworks]
    raise ConfigError(
        f"trainer.strategy: '{name}' trains {'/'.join(sorted(found.frameworks))} modules, but {module_name} "
        f"is a {framework} module; use one of: {', '.join(fits)}"
    )
