"""SageMaker integration: read SageMaker's environment and run an experiment the way it expects.

A ModelTrainer (or an SDK 2 estimator) runs `train.py` holding `from unifit.sagemaker import main; main()`,
with hyperparameters such as {"config": "exp.yaml", "trainer": {"max_epochs": 10}}. SageMaker passes them as
`--config exp.yaml --trainer '{"max_epochs": 10}'`, merged key by key as unifit's own overrides
(`--trainer.max_epochs 10`, the form SDK 2 also takes).
Or a script of the user's that makes its own Trainer (or uses TensorFlow's strategies itself):
{"script": "train_ps.py", "strategy": "parameter-server", ...}; the other hyperparameters are its arguments.
What SageMaker provides is mapped onto the config:

- SM_HOSTS / SM_CURRENT_HOST / SM_NUM_GPUS: hosts, node rank and processes per host for the
  launcher (master: the first host), when SageMaker itself started one process per host;
- a launcher SageMaker already ran (torch_distributed -> torchrun, mpi / smdistributed ->
  mpirun) is detected from its variables, and then each process trains directly;
- trainer.strategy parameter-server: without an estimator distribution unifit starts the cluster itself
  (--nproc-per-node workers and --num-ps parameter servers on every host, default 1 and 1; the chief on the first
  host); with `distribution={"parameter_server": {"enabled": True}}` SageMaker's toolkit starts one parameter
  server per host and runs this entry point with TF_CONFIG: the first host ("master") is the chief, every other
  host serves as a worker until the chief ends;
- SM_CHANNEL_<NAME>: replaces `data.init_args.<name>` when the data section has that key
  (a glob's file pattern is kept: train-*.npz -> <channel dir>/train-*.npz);
- SM_MODEL_DIR: trainer.export_dir (the final model, uploaded by SageMaker as model.tar.gz);
- SM_OUTPUT_DATA_DIR: base of relative root_dir, checkpoint.dir and tensorboard.log_dir
  (uploaded by SageMaker as output.tar.gz).
"""

from __future__ import annotations

import json
import os
import posixpath
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from unifit.errors import ConfigError, UnifitError
from unifit.strategies.environment import parse_hosts


@dataclass(frozen=True)
class SageMakerEnvironment:
    hosts: list[str]
    current_host: str
    num_gpus: int = 0
    num_cpus: int = 1
    model_dir: str | None = None
    output_data_dir: str | None = None
    channels: dict[str, str] = field(default_factory=dict)
    # where SageMaker syncs checkpoint_s3_uri (managed spot training); present only when the estimator set it
    checkpoint_dir: str | None = None

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> SageMakerEnvironment | None:
        env = os.environ if env is None else env
        if "SM_HOSTS" not in env:
            return None
        hosts = parse_hosts(env["SM_HOSTS"])
        current = env.get("SM_CURRENT_HOST", "")
        if current not in hosts:
            raise ConfigError(f"SM_CURRENT_HOST: received {current!r}, which is not in SM_HOSTS {hosts}")
        channels = {k[len("SM_CHANNEL_") :].lower(): v for k, v in env.items() if k.startswith("SM_CHANNEL_")}
        checkpoints = env.get("UNIFIT_SM_CHECKPOINT_DIR", SPOT_CHECKPOINT_DIR)
        return cls(
            hosts=hosts,
            current_host=current,
            num_gpus=int(env.get("SM_NUM_GPUS") or 0),
            num_cpus=int(env.get("SM_NUM_CPUS") or 1),
            model_dir=env.get("SM_MODEL_DIR"),
            output_data_dir=env.get("SM_OUTPUT_DATA_DIR"),
            channels=channels,
            checkpoint_dir=checkpoints if os.path.isdir(checkpoints) else None,
        )

    @property
    def node_rank(self) -> int:
        return self.hosts.index(self.current_host)

    def overrides(self, config: dict[str, Any]) -> dict[str, str]:
        """Dotted overrides that map SageMaker's locations onto the experiment `config`."""
        out: dict[str, str] = {}
        data_args = (config.get("data") or {}).get("init_args") or {}
        for name, path in sorted(self.channels.items()):
            if name in data_args:
                out[f"data.init_args.{name}"] = json.dumps(_in_channel(data_args[name], path))
        trainer = config.get("trainer") or {}
        if self.model_dir and not trainer.get("export_dir"):
            out["trainer.export_dir"] = self.model_dir
        own = (trainer.get("checkpoint") or {}).get("dir")
        if self.checkpoint_dir and (not own or ("://" not in own and not os.path.isabs(own))):
            # SageMaker restores this directory from checkpoint_s3_uri when a spot job restarts: resume from it
            # (a relative checkpoint dir would go to the output dir, uploaded only when the job ends)
            out["trainer.checkpoint.dir"] = self.checkpoint_dir
            if not trainer.get("resume"):
                out["trainer.resume"] = "auto"
        locations = {
            "trainer.root_dir": trainer.get("root_dir", "runs/default"),
            "trainer.checkpoint.dir": (trainer.get("checkpoint") or {}).get("dir"),
            "trainer.tensorboard.log_dir": (trainer.get("tensorboard") or {}).get("log_dir"),
        }
        for key, path in locations.items():
            if key in out:
                continue
            if self.output_data_dir and path and "://" not in path and not os.path.isabs(path):
                out[key] = posixpath.join(self.output_data_dir, path)
        return out


SPOT_CHECKPOINT_DIR = "/opt/ml/checkpoints"  # the estimator's checkpoint_local_path default


def _in_channel(original: Any, channel_dir: str) -> Any:
    """Point a data location at the channel directory, keeping a glob's file pattern."""
    if isinstance(original, str) and any(c in original for c in "*?["):
        return posixpath.join(channel_dir, posixpath.basename(original))
    return channel_dir


def under_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True when a launcher (torchrun, mpirun, TF_CONFIG workers) already started this process."""
    from unifit.strategies import environment

    return environment.detect(env).source != "none"


def main(argv: Sequence[str] | None = None) -> int:
    """The SageMaker entry point: fit directly under a launcher, else launch one per host."""
    from unifit.cli import main as cli

    argv = list(sys.argv[1:] if argv is None else argv)
    cli._log_to_stderr()
    try:
        return _main(argv)
    except UnifitError as exc:
        print(f"unifit: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _main(argv: list[str]) -> int:
    import argparse

    from unifit.cli import main as cli
    from unifit.config.loading import apply_overrides, load_yaml
    from unifit.strategies import registry

    parser = argparse.ArgumentParser(prog="unifit-sagemaker")
    parser.add_argument("--config", "-c", default=None)
    parser.add_argument("--script", default=None, help="instead of --config: a script that makes its own Trainer")
    parser.add_argument("--strategy", default=None, help="with --script: the strategy whose processes run it")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None)
    parser.add_argument("--master-port", "--master_port", type=int, default=None)
    parser.add_argument("--num-ps", "--num_ps", type=int, default=1, help="parameter-server: per host")
    args, extra = parser.parse_known_args(argv)
    sm = SageMakerEnvironment.detect()
    if sm is None:
        raise ConfigError(
            "unifit.sagemaker: SM_HOSTS is not set; this entry point runs inside SageMaker "
            "(or its local training toolkit); elsewhere use `unifit fit` / `unifit launch`"
        )
    if bool(args.config) == bool(args.script):
        raise ConfigError(
            f"unifit.sagemaker: received config={args.config!r} and script={args.script!r}; give one hyperparameter: "
            "config (an experiment file) or script (a Python script that makes its own Trainer, with strategy)"
        )
    if args.script:
        return _script_job(args, extra, sm)
    overrides = cli.parse_overrides(dotted_arguments(extra))
    overrides.update(sm.overrides(apply_overrides(load_yaml(args.config), overrides)))
    fit_args = ["-c", args.config]
    for key, value in overrides.items():
        fit_args += [f"--{key}", value]
    if _parameter_server_distribution():
        launcher = registry.launcher(cli.load_experiment(args.config, overrides).trainer.strategy)
        if not launcher.starts_parameter_servers:
            raise ConfigError(
                f"trainer.strategy: received {launcher.strategy!r}, but the estimator's distribution is "
                "parameter_server (TF_CONFIG has 'ps' tasks); set trainer.strategy: parameter-server, or drop the "
                "distribution argument"
            )
        if not _is_chief():
            return _serve()
    if under_launcher():
        return cli.main(["fit", *fit_args])
    experiment = cli.load_experiment(args.config, overrides)
    launcher = registry.launcher(experiment.trainer.strategy)
    spec = _spec(args, sm, launcher.starts_parameter_servers, fit_args=fit_args)
    if spec.nnodes == 1 and spec.nproc_per_node == 1 and not spec.num_ps:
        return cli.main(["fit", *fit_args])
    return launcher.launch(spec)


def dotted_arguments(arguments: list[str]) -> list[str]:
    """Hyperparameters given nested, `{"trainer": {"max_epochs": 10}}`, as dotted overrides, key by key.

    SageMaker SDK 3's container script exports every hyperparameter as SM_HP_<NAME>, which fails on a dotted name
    ("not a valid identifier") before the entry point runs: under ModelTrainer the overrides come as one JSON object
    per section (`--trainer '{"max_epochs": 10}'`), merged into the experiment as the dotted form would be.
    """
    out: list[str] = []
    items = list(arguments)
    while items:
        flag = items.pop(0)
        value = _json_object(items[0]) if flag.startswith("--") and "=" not in flag and items else None
        if value is None:
            out.append(flag)
            continue
        items.pop(0)
        for key, leaf in _leaves(flag[2:], value):
            out += [f"--{key}", leaf]
    return out


def _json_object(raw: str) -> dict[str, Any] | None:
    if not raw.lstrip().startswith("{"):
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) and value else None


def _leaves(prefix: str, value: Any) -> list[tuple[str, str]]:
    if isinstance(value, dict) and value:
        return [leaf for key, child in value.items() for leaf in _leaves(f"{prefix}.{key}", child)]
    return [(prefix, json.dumps(value))]


def _script_job(args: Any, script_args: list[str], sm: SageMakerEnvironment) -> int:
    """The hyperparameter `script` (the others are its arguments): run where SageMaker's distribution started this
    process, else launched on every host as `unifit launch --strategy S -- SCRIPT.py` would."""
    from unifit.cli import main as cli
    from unifit.strategies import registry
    from unifit.strategies.launchers.base import LAUNCH_STRATEGY_ENV

    script = [args.script, *script_args]
    if _parameter_server_distribution():
        if args.strategy not in (None, "parameter-server"):
            raise ConfigError(
                f"strategy: received {args.strategy!r}, but the estimator's distribution is parameter_server "
                "(TF_CONFIG has 'ps' tasks); give strategy parameter-server, or drop the distribution argument"
            )
        if not _is_chief():
            return _serve()
        from unifit.strategies.tf_server import chief_named

        # the script's own TFConfigClusterResolver reads TF_CONFIG: TensorFlow 2's ParameterServerStrategy needs the
        # coordinator's task named "chief", not SageMaker's "master"
        os.environ["TF_CONFIG"] = json.dumps(chief_named(os.environ["TF_CONFIG"]))
        os.environ[LAUNCH_STRATEGY_ENV] = "parameter-server"
        return cli.main(["script", *script])
    if not args.strategy:
        raise ConfigError(
            f"unifit.sagemaker: script={args.script!r} needs the hyperparameter strategy (e.g. mwms, ddp, "
            "parameter-server): the strategy whose processes run it"
        )
    launcher = registry.launcher(args.strategy)
    if under_launcher():
        os.environ[LAUNCH_STRATEGY_ENV] = args.strategy
        return cli.main(["script", *script])
    env = {LAUNCH_STRATEGY_ENV: args.strategy}
    return launcher.launch(_spec(args, sm, launcher.starts_parameter_servers, script=script, env=env))


def _spec(args: Any, sm: SageMakerEnvironment, parameter_servers: bool, **given: Any) -> Any:
    """The launch of this host's processes, from SageMaker's hosts and the hyperparameters."""
    from unifit.strategies.launchers.base import LaunchSpec

    return LaunchSpec(
        nproc_per_node=args.nproc_per_node or max(1, sm.num_gpus),
        nnodes=len(sm.hosts),
        node_rank=sm.node_rank,
        master_addr=sm.hosts[0],
        master_port=args.master_port or int(os.environ.get("UNIFIT_MASTER_PORT", 29500)),
        hosts=sm.hosts if len(sm.hosts) > 1 else None,  # one host: its tasks on 127.0.0.1 (its name may not resolve)
        num_ps=args.num_ps if parameter_servers else 0,
        **given,
    )


def _parameter_server_distribution() -> bool:
    """SageMaker's parameter_server distribution started the parameter servers: TF_CONFIG has 'ps' tasks."""
    return bool((json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster") or {}).get("ps"))


def _is_chief() -> bool:
    task = json.loads(os.environ["TF_CONFIG"]).get("task") or {}
    return str(task.get("type", "")).lower() in ("chief", "master")


def _serve() -> int:
    """A worker host of the parameter_server distribution: serve as a worker until the chief ends."""
    from unifit.strategies.launchers.parameter_servers import serve_task

    return serve_task(os.environ["TF_CONFIG"])
