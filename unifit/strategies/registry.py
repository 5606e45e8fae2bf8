"""Strategy names -> where they live, which frameworks they run, and how they are launched.

Entries are dotted paths so torch, TensorFlow and Horovod are imported only when the strategy
is used. Adding a strategy means adding one line here and one file beside this one; a strategy of your own
needs neither: name its class path (`trainer.strategy: pkg.module:MyStrategy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from unifit._imports import load_object
from unifit.errors import ConfigError

if TYPE_CHECKING:
    from unifit.strategies.base import Strategy
    from unifit.strategies.environment import ClusterEnvironment
    from unifit.strategies.launchers.base import Launcher


@dataclass(frozen=True)
class StrategyEntry:
    name: str
    strategy: str  # dotted path of the Strategy class
    launcher: str  # dotted path of the Launcher class that starts its processes
    frameworks: frozenset[str]  # module frameworks it can train
    summary: str


_REGISTRY: dict[str, StrategyEntry] = {}


def register(entry: StrategyEntry) -> None:
    _REGISTRY[entry.name] = entry


register(
    StrategyEntry(
        "single",
        "unifit.strategies.single:SingleStrategy",
        "unifit.strategies.launchers.base:SingleProcessLauncher",
        frozenset({"torch", "tensorflow"}),
        "one process, one device",
    )
)
register(
    StrategyEntry(
        "ddp",
        "unifit.strategies.ddp:DDPStrategy",
        "unifit.strategies.launchers.torchrun:TorchrunLauncher",
        frozenset({"torch"}),
        "PyTorch DistributedDataParallel, launched by torchrun",
    )
)
register(
    StrategyEntry(
        "smddp-like",
        "unifit.strategies.smddp:SMDDPLikeStrategy",
        "unifit.strategies.launchers.torchrun:TorchrunLauncher",
        frozenset({"torch"}),
        "DDP with SageMaker-style hierarchical allreduce (the real smddp where installed)",
    )
)

register(
    StrategyEntry(
        "fsdp",
        "unifit.strategies.fsdp:FSDPStrategy",
        "unifit.strategies.launchers.torchrun:TorchrunLauncher",
        frozenset({"torch"}),
        "PyTorch FSDP2: parameters, gradients and optimizer state sharded over the ranks",
    )
)
register(
    StrategyEntry(
        "horovod",
        "unifit.strategies.horovod.strategy:HorovodStrategy",
        "unifit.strategies.launchers.horovodrun:HorovodrunLauncher",
        frozenset({"torch", "tensorflow"}),
        "Horovod ring-allreduce, launched by horovodrun",
    )
)
register(
    StrategyEntry(
        "mirrored",
        "unifit.strategies.tf_distribute:MirroredStrategy",
        "unifit.strategies.launchers.base:SingleProcessLauncher",
        frozenset({"tensorflow"}),
        "TensorFlow MirroredStrategy: one process, all local devices",
    )
)
register(
    StrategyEntry(
        "mwms",
        "unifit.strategies.tf_distribute:MWMSStrategy",
        "unifit.strategies.launchers.tf_config:TFConfigLauncher",
        frozenset({"tensorflow"}),
        "TensorFlow MultiWorkerMirroredStrategy: one process per worker (TF_CONFIG)",
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
            f"trainer.strategy: unknown strategy '{name}'; valid strategies: {', '.join(_REGISTRY)}, "
            "or the class path of a Strategy subclass (pkg.module:MyStrategy)"
        )
    return _entry_of_class(name)


def _entry_of_class(path: str) -> StrategyEntry:
    from unifit.strategies.base import Strategy
    from unifit.strategies.keras_training import KerasTraining
    from unifit.strategies.torch_training import TorchTraining

    cls = load_object(path, field="trainer.strategy")
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(
            f"trainer.strategy: '{path}' is {cls!r}, not a subclass of unifit.strategies.Strategy; "
            "name a registered strategy or your Strategy subclass"
        )
    frameworks = frozenset(
        {fw for fw, mixin in (("torch", TorchTraining), ("tensorflow", KerasTraining)) if issubclass(cls, mixin)}
    )
    if not frameworks:
        raise ConfigError(
            f"trainer.strategy: {cls.__name__} trains no framework; mix in "
            "unifit.strategies.torch_training.TorchTraining and/or keras_training.KerasTraining"
        )
    return StrategyEntry(path, path, cls.launcher, frameworks, (cls.__doc__ or path).strip().splitlines()[0])


def create(name: str, env: ClusterEnvironment, **kwargs: object) -> Strategy:
    found = entry(name)
    cls = load_object(found.strategy, field="trainer.strategy")
    return cls(env, **kwargs)


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
