"""The `unifit` command: fit, print-config, launch.

    unifit fit -c exp.yaml [--trainer.max_epochs 3 ...] [--ckpt-path last]
    unifit validate | test | predict -c exp.yaml [--ckpt-path best|last|DIR] [--output predictions.pt]
    unifit print-config -c exp.yaml [overrides]
    unifit launch --nproc-per-node 2 [--nnodes N --node-rank R --rdzv-endpoint H:P] -c exp.yaml [overrides]
    unifit launch --nproc-per-node 2 --strategy ddp -- train.py [script args]   (a script that makes a Trainer)
    unifit submit -c exp.yaml --nodes 2 --gpus-per-node 4 [--partition P] [overrides]   (SLURM, via submitit)
    unifit plot RUN_DIR [RUN_DIR ...] -o curves.png

User errors print one line and exit 2 (1 for failures during training); UNIFIT_DEBUG=1 shows tracebacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from unifit.errors import ConfigError, UnifitError, error_prefix, first_line
from unifit.strategies.launchers.base import LAUNCH_STRATEGY_ENV
from unifit.strategies.tf_server import END_WITH_PARENT, end_with_parent

if TYPE_CHECKING:
    from unifit.strategies.environment import ClusterEnvironment

_SECTIONS = (
    "module.",
    "data.",
    "trainer.",
    "model.",
    "seed_everything",
    "ckpt_path",
)  # model...: a LightningCLI file's


def _parser() -> argparse.ArgumentParser:
    from unifit.strategies import registry

    parser = argparse.ArgumentParser(
        prog="unifit",
        description="Train a unifit module from a YAML experiment file. Strategies (trainer.strategy): "
        + ", ".join(registry.names())
        + ", or the class path of your own (pkg.module:MyStrategy).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def experiment_args(p: argparse.ArgumentParser, required: bool = True) -> None:
        p.add_argument("-c", "--config", required=required, help="experiment YAML file")
        p.epilog = "Any config field can be overridden with a dotted flag, e.g. --trainer.max_epochs 3."

    fit = sub.add_parser("fit", help="train (in this process; under torchrun/horovodrun in each rank)")
    experiment_args(fit)
    fit.add_argument(
        "--ckpt-path",
        default=None,
        help="resume: 'auto' (last committed checkpoint, else start fresh), 'last', 'best', a checkpoint name or directory",
    )
    show = sub.add_parser("print-config", help="print the fully resolved config")
    experiment_args(show)
    launch = sub.add_parser(
        "launch",
        help="start the processes of the configured strategy (" + ", ".join(registry.names()) + ")",
        description="Start the processes of the configured strategy: "
        + "; ".join(f"{registry.entry(name).name}: {registry.entry(name).summary}" for name in registry.names())
        + ".",
    )
    experiment_args(launch, required=False)
    launch.add_argument(
        "--strategy",
        default=None,
        help="with '-- SCRIPT.py [ARGS]' instead of -c: the strategy whose processes run the script "
        "(its Trainer takes this strategy when it names none)",
    )
    submit = sub.add_parser(
        "submit",
        help="queue `unifit fit` on SLURM through submitit: one task per GPU, requeued from its last checkpoint",
    )
    experiment_args(submit)
    submit.add_argument("--nodes", type=int, default=1)
    submit.add_argument("--gpus-per-node", type=int, default=0, help="one task per GPU")
    submit.add_argument("--tasks-per-node", type=int, default=None, help="default: one per GPU (1 without)")
    submit.add_argument("--partition", default=None, help="SLURM partition")
    submit.add_argument("--time-min", type=int, default=60, help="the job's time limit, in minutes")
    submit.add_argument("--folder", default="submitit", help="where submitit keeps the job's files and logs")
    submit.add_argument("--local", action="store_true", help="run the tasks on this machine (no SLURM)")
    submit.add_argument("--wait", action="store_true", help="wait for the job and end with its outcome")
    for stage in ("validate", "test", "predict"):
        run = sub.add_parser(stage, help=f"{stage} with a checkpoint's weights, sharded over the ranks")
        experiment_args(run)
        run.add_argument(
            "--ckpt-path",
            default=None,
            help="'best', 'last', a checkpoint name or directory (default: the module's weights as built)",
        )
        if stage == "predict":
            run.add_argument(
                "--output",
                default=None,
                help="where rank 0 writes the predictions, in dataset order "
                "(.pt: torch.save, .npy: numpy, .pkl: pickle; local or "
                "s3://); default <root_dir>/predictions.pkl",
            )
    launch.add_argument(
        "--run",
        default="fit",
        choices=("fit", "validate", "test", "predict"),
        help="what every started process runs (default: fit)",
    )
    launch.add_argument("--output", default=None, help="with --run predict: as for predict")
    # unset: a Kubeflow TrainJob pod's PET_* values, else 1 process on 1 node (see _pod_defaults)
    launch.add_argument("--nproc-per-node", type=int, default=None)
    launch.add_argument("--nnodes", type=int, default=None)
    launch.add_argument("--node-rank", type=int, default=None)
    launch.add_argument("--master-addr", default=None)
    launch.add_argument("--master-port", type=int, default=None)
    launch.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous (multi-node)")
    launch.add_argument(
        "--hosts", default=None, help="comma-separated hosts: mwms and parameter-server tasks on several hosts"
    )
    launch.add_argument(
        "--num-ps",
        type=int,
        default=0,
        help="parameter servers to start (trainer.strategy or --strategy parameter-server; a script then runs as "
        "the chief, with TF_CONFIG)",
    )
    launch.add_argument("--ckpt-path", default=None, help="as for fit; with --max-restarts the default is 'auto'")
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart every rank this many times after one fails, resuming from the last committed "
        "checkpoint (torchrun's elastic agent: ddp, smddp-like, fsdp)",
    )
    board = sub.add_parser(
        "tensorboard", help="serve TensorBoard for logs on S3 or any fsspec URL (kept mirrored locally)"
    )
    board.add_argument("url", help="e.g. s3://bucket/run/tensorboard")
    board.add_argument("--host", default="127.0.0.1")
    board.add_argument("--port", type=int, default=6006)
    board.add_argument("--refresh-s", type=float, default=10.0, help="seconds between mirror refreshes")
    board.add_argument(
        "--storage-options", default="{}", help="fsspec options as YAML/JSON, e.g. '{endpoint_url: http://...}'"
    )
    from unifit import plot  # light: matplotlib is imported only when plotting

    plot.add_arguments(
        sub.add_parser(
            "plot", help="draw the curves of run directories (metrics.jsonl) into a PNG, SVG, PDF or HTML file"
        )
    )
    return parser


def parse_overrides(extra: Sequence[str]) -> dict[str, str]:
    """['--trainer.max_epochs', '3', '--module.init_args.lr=0.1'] -> {'trainer.max_epochs': '3', ...}."""
    overrides: dict[str, str] = {}
    items = list(extra)
    while items:
        flag = items.pop(0)
        if not flag.startswith("--") or not flag[2:].startswith(_SECTIONS):
            raise ConfigError(
                f"unknown argument '{flag}'; overrides look like --trainer.max_epochs 3 (sections: module, data, trainer; "
                "model and seed_everything in a LightningCLI file)"
            )
        key, eq, value = flag[2:].partition("=")
        if not eq:
            if not items:
                raise ConfigError(f"override '{flag}' has no value; write {flag} VALUE")
            value = items.pop(0)
        overrides[key] = value
    return overrides


def load_experiment(path: str, overrides: dict[str, str]) -> Any:
    """The validated experiment; its strategy and the init_args of its classes are checked after the
    schema, once user code is importable (a strategy may be the class path of the user's own Strategy)."""
    from unifit.config.lightning_cli import from_lightning_cli, is_lightning_cli
    from unifit.config.loading import apply_overrides, check_classes, load_yaml, validate_experiment
    from unifit.strategies import registry

    raw = apply_overrides(load_yaml(path), overrides)
    lightning_run = from_lightning_cli(raw, path) if is_lightning_cli(raw) else None
    experiment = validate_experiment(lightning_run.experiment if lightning_run else raw, source=path)
    experiment._lightning_run = lightning_run  # the processes a LightningCLI file asks for, checked where they run
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # let class paths name modules of the working directory
    try:
        registry.strategy_class(experiment.trainer.strategy).validate_options(experiment.trainer.strategy_options)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    check_classes(experiment)
    return experiment


def _fit(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    trainer, module, data = _experiment_objects(args, overrides)
    trainer.fit(module, data=data, ckpt_path=args.ckpt_path)
    return 0


def _evaluate(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    from unifit.trainer.evaluation import evaluate
    from unifit.trainer.predictions import write_metrics, write_predictions

    trainer, module, data = _experiment_objects(args, overrides)
    result = evaluate(trainer.config, args.command, module, data, args.ckpt_path)
    if _launched_environment().rank != 0:
        return 0
    root, options = trainer.config.root_dir.rstrip("/"), trainer.config.storage_options
    if result.predictions is not None:
        output = args.output or f"{root}/predictions.pkl"
        write_predictions(result.predictions, output, options)
        print(f"predict: {_count(result.predictions)} predictions written to {output}", flush=True)
    if result.metrics:
        write_metrics(result.metrics, result.checkpoint, f"{root}/{args.command}.json", options)
        print(
            f"{args.command}: "
            + "  ".join(f"{k}={v:.6g}" for k, v in sorted(result.metrics.items()))
            + f"  (all digits in {root}/{args.command}.json)",
            flush=True,
        )
    return 0


def _count(predictions: Any) -> int:
    return len(predictions) if hasattr(predictions, "__len__") else 1


def _experiment_objects(args: argparse.Namespace, overrides: dict[str, str]) -> tuple[Any, Any, Any]:
    """(Trainer, module, data) of the experiment file, built in this process."""
    from unifit._imports import load_object
    from unifit.config.init_args import build
    from unifit.trainer.trainer import Trainer

    experiment = load_experiment(args.config, overrides)
    if experiment._lightning_run is not None:
        from unifit.config.lightning_cli import check_processes

        env = _launched_environment()
        check_processes(experiment._lightning_run, env.local_world_size, env.world_size, args.config)
    trainer = Trainer(experiment.trainer)
    trainer.experiment = experiment
    load_object(experiment.module.class_path, field="module.class_path")  # its framework (torch) loaded to be seeded
    _seed_init(experiment.trainer.seed)
    module = build(experiment.module.class_path, experiment.module.init_args, "module")  # nested objects too
    data = None
    if experiment.data is not None:
        data = build(experiment.data.class_path, experiment.data.init_args, "data")
    return trainer, module, data


def _seed_init(seed: int) -> None:
    """Same initial weights on every rank before the module is built (then broadcast anyway)."""
    import random

    random.seed(seed)
    if "torch" in sys.modules:  # a torch module's class is loaded by now; Keras workers skip torch's import
        import torch

        torch.manual_seed(seed)


def _launch(args: argparse.Namespace, overrides: dict[str, str], fit_args: list[str], script: list[str]) -> int:
    from unifit.strategies import registry
    from unifit.strategies.launchers.base import LaunchSpec

    experiment = None if script else load_experiment(args.config, overrides)
    strategy = _script_strategy(args, overrides, script) if experiment is None else experiment.trainer.strategy
    args = _pod_defaults(args, os.environ)
    spec = LaunchSpec(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
        fit_args=fit_args,
        command=args.run,
        hosts=args.hosts.split(",") if args.hosts else None,
        max_restarts=args.max_restarts,
        num_ps=args.num_ps,
        script=script,
        env={LAUNCH_STRATEGY_ENV: strategy} if script else {},
    )
    if args.output and args.run != "predict":
        raise ConfigError(f"--output {args.output}: only --run predict writes predictions (received --run {args.run})")
    if spec.max_restarts < 0:
        raise ConfigError(f"--max-restarts: received {spec.max_restarts}; give 0 or more")
    if spec.hosts and spec.nnodes == 1:
        spec = dataclasses.replace(spec, nnodes=len(spec.hosts))
    if spec.nproc_per_node < 1 or spec.nnodes < 1:
        raise ConfigError(f"--nproc-per-node {spec.nproc_per_node} --nnodes {spec.nnodes}: both must be >= 1")
    if experiment is not None:  # the layout against the world about to start, before it starts
        cls = registry.strategy_class(strategy)
        cls.check_launch(
            cls.validate_options(experiment.trainer.strategy_options),
            world_size=spec.nproc_per_node * spec.nnodes,
            nproc_per_node=spec.nproc_per_node,
            accelerator=experiment.trainer.accelerator,
        )
    from unifit.strategies.launchers.notices import notices_passed_on

    with notices_passed_on():  # SIGUSR1/2 to the launch (srun --signal, submitit) go on to the ranks
        return registry.launcher(strategy).launch(spec)


def _pod_defaults(args: argparse.Namespace, env: Mapping[str, str]) -> argparse.Namespace:
    """The flags `unifit launch` was not given, from a Kubeflow pod's PET_* variables (a TrainJob's torch runtime
    sets them for torchrun, which reads them as its own flags; a PyTorchJob sets MASTER_ADDR/PORT instead), else
    one process on one node."""
    from unifit.strategies.environment import config_int, trainjob_processes_per_pod

    pod = "PET_NNODES" in env
    given = vars(args)
    found = {
        "nproc_per_node": trainjob_processes_per_pod(env) if pod else 1,
        "nnodes": config_int(env, "PET_NNODES", 1) if pod else 1,
        "node_rank": config_int(env, "PET_NODE_RANK", 0) if pod else 0,
        "master_addr": (env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")) if pod else None,
        "master_port": (
            config_int(env, "PET_MASTER_PORT", 0) or config_int(env, "MASTER_PORT", 0) or None if pod else None
        ),
    }
    taken = {name: value for name, value in found.items() if given.get(name) is None}
    if pod and taken and any(v is not None for v in taken.values()):
        logging.getLogger("unifit").info(
            "unifit launch: from the pod's environment: %s", ", ".join(f"{k}={v}" for k, v in taken.items())
        )
    return argparse.Namespace(**{**given, **taken})


def _script_strategy(args: argparse.Namespace, overrides: dict[str, str], script: list[str]) -> str:
    """`unifit launch --strategy NAME -- SCRIPT.py [ARGS]`: the strategy, once the script is checked."""
    from unifit.strategies import registry

    if args.config:
        raise ConfigError(
            f"unifit launch: received -c {args.config} and a script ({script[0]}); give one: -c exp.yaml "
            "runs the experiment, '-- SCRIPT.py' runs a script that makes its own Trainer"
        )
    if overrides or args.run != "fit" or args.output or args.ckpt_path:
        raise ConfigError(
            "unifit launch -- SCRIPT.py: the script sets its own options (Trainer(...), fit(...)); "
            "overrides, --run, --output and --ckpt-path apply to -c exp.yaml only"
        )
    if not args.strategy:
        raise ConfigError(
            f"unifit launch -- {script[0]}: name the strategy whose processes run it, e.g. "
            f"unifit launch --nproc-per-node 2 --strategy ddp -- {' '.join(script)}"
        )
    if not script[0].endswith(".py") or not os.path.isfile(script[0]):
        raise ConfigError(
            f"unifit launch -- {script[0]}: not a Python script file; give the path of a .py file "
            "(each process runs it with this Python)"
        )
    registry.entry(args.strategy)
    return args.strategy


def _log_to_stderr() -> None:
    """unifit's own messages on stderr (other libraries' logging is left as they set it)."""
    logger = logging.getLogger("unifit")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("unifit: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


_owns_process = True  # main(): a launched rank's error or end leaves the process at once (see _exit_with)


def main(argv: Sequence[str] | None = None) -> int:
    code = _command(list(sys.argv[1:] if argv is None else argv))
    _end_launched_rank(code)
    return code


def run(argv: Sequence[str]) -> int:
    """A unifit command (`["fit", "-c", "exp.yaml", ...]`) in this process, for a caller that owns the process
    (submitit's task, a notebook): its exit code comes back and the process goes on; an error is the same one
    line on stderr. A BaseException that is not unifit's (submitit's requeue exit) passes through."""
    global _owns_process
    owned, _owns_process = _owns_process, False
    try:
        return _command(list(argv))
    finally:
        _owns_process = owned


def _command(argv: list[str]) -> int:
    _log_to_stderr()
    # checking the experiment imports the user's module, which may import TensorFlow: its start-up INFO and
    # WARNING lines would come before unifit's one-line answer (the Keras engine sets the same; yours wins)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if os.environ.pop(END_WITH_PARENT, None) == "1":  # a parameter-server chief whose launch was killed: its
        end_with_parent(signal.SIGKILL)  # servers are gone with it, so no checkpoint could be written: end now
    script: list[str] = []
    if argv[:1] == ["script"]:  # a launched rank of `unifit launch -- SCRIPT.py [ARGS]`
        return _run_script(argv[1:])
    if argv[:1] == ["launch"] and "--" in argv:  # unifit launch [flags] -- SCRIPT.py [ARGS]
        at = argv.index("--")
        argv, script = argv[:at], argv[at + 1 :]
    args, extra = _parser().parse_known_args(argv)
    try:
        overrides = parse_overrides(extra) if args.command not in ("tensorboard", "plot") else {}
        if args.command == "plot":
            from unifit.plot import run_command

            return run_command(args, extra)
        if args.command == "print-config":
            from unifit.config.loading import resolved_yaml

            print(resolved_yaml(load_experiment(args.config, overrides)), end="")
            return 0
        if args.command == "tensorboard":
            from unifit.config.loading import parse_yaml
            from unifit.tensorboard_view import serve

            options = parse_yaml(args.storage_options) or {}
            if extra or not isinstance(options, dict):
                raise ConfigError(
                    f"unifit tensorboard: unexpected arguments {extra or args.storage_options!r}; "
                    "usage: unifit tensorboard URL [--port N] [--storage-options '{...}']"
                )
            serve(args.url, host=args.host, port=args.port, refresh_s=args.refresh_s, storage_options=options)
            return 0
        if args.command == "launch":
            if not args.config and not script:
                raise ConfigError(
                    "unifit launch: give -c exp.yaml (the experiment each process runs) or "
                    "--strategy NAME -- SCRIPT.py [ARGS] (a script that makes its own Trainer)"
                )
            if args.strategy and not script:
                raise ConfigError(
                    f"unifit launch --strategy {args.strategy}: with -c the experiment names the "
                    f"strategy; override it with --trainer.strategy {args.strategy}"
                )
            ckpt = args.ckpt_path or (
                "auto" if args.max_restarts > 0 and not script else None
            )  # a restarted rank continues
            fit_args = ["-c", args.config or "", *extra] + (["--ckpt-path", ckpt] if ckpt else [])
            if args.output:
                fit_args += ["--output", args.output]
            return _launch(args, overrides, fit_args, script)
        if args.command == "submit":
            from unifit.cli.submit import main_submit

            return main_submit(args, extra, load_experiment(args.config, overrides), run)
        if args.command in ("validate", "test", "predict"):
            return _evaluate(args, overrides)
        return _fit(args, overrides)
    except UnifitError as exc:
        if os.environ.get("UNIFIT_DEBUG"):
            raise
        return _exit_with(str(exc), exc.exit_code)
    except Exception as exc:  # not the user's input: the original error, located, in one line
        if os.environ.get("UNIFIT_DEBUG"):
            raise
        frames = traceback.extract_tb(exc.__traceback__)
        own = [f for f in frames if "site-packages" not in f.filename] or frames  # the user's or unifit's code
        where = f" (at {own[-1].filename}:{own[-1].lineno} in {own[-1].name})" if own else ""
        return _exit_with(f"{type(exc).__name__}: {first_line(exc)}{where}; UNIFIT_DEBUG=1 shows the traceback", 1)


def _run_script(script: list[str]) -> int:
    """Run SCRIPT.py [ARGS] as `python SCRIPT.py` would (its own __main__, argv and path); a refusal of unifit's
    (UnifitError) ends it with unifit's one line and exit code instead of a traceback; any other error is the
    script's own, shown as Python shows it, exit code 1. Either way the code comes back to main(), so a launched
    rank ends through _end_launched_rank: TensorFlow's collective and gRPC server threads, still running at
    interpreter shutdown, can crash it there (SIGSEGV, SIGABRT after a successful mwms run: tensorflow/tensorflow
    #56684, #55250), which would replace a script's exit code with a signal."""
    import runpy

    if not script:
        return _exit_with("unifit script: give SCRIPT.py [ARGS]", 2)
    sys.argv = list(script)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script[0])))
    try:
        if "ps" in os.environ.get("TF_CONFIG", ""):  # a parameter-server chief: its cluster up, or one line
            from unifit.strategies.parameter_server import wait_for_the_cluster_of_a_script

            wait_for_the_cluster_of_a_script()
        runpy.run_path(script[0], run_name="__main__")
    except UnifitError as exc:
        if os.environ.get("UNIFIT_DEBUG"):
            raise
        return _exit_with(str(exc), exc.exit_code)
    except SystemExit as exc:  # the script's own sys.exit(): its code, as python would end with it
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except Exception:  # the script's own error: its traceback, as python prints it, and python's exit code
        traceback.print_exc()
        return 1
    return 0


def _exit_with(message: str, code: int) -> int:
    from unifit.storage import redact_url

    env = _launched_environment()
    message = redact_url(message)  # a tracking or storage URL in an error may carry credentials
    sys.stderr.write(error_prefix(env.rank) + message.replace("\n", " ") + "\n")  # one write: ranks share the terminal
    if env.source != "none" and _owns_process:  # a launched rank: skip interpreter shutdown, where a torn-down gloo
        sys.stdout.flush()  # group can abort (SIGABRT) and hide this exit code from the launcher
        sys.stderr.flush()
        os._exit(code)
    return code


def _end_launched_rank(code: int) -> None:
    """A launched rank that got this far ends without interpreter finalization, after the exit functions (the
    process group's teardown, logging's, the user's own atexit handlers) and the threads Python would wait for:
    gloo's C++ worker threads can still hold tensors whose release takes the GIL while the interpreter is torn
    down, and the process aborts there (SIGABRT, 'terminate called without an active exception', about once in a
    hundred launches; pytorch/pytorch#179291) after training finished, failing a run that succeeded."""
    if _launched_environment().source == "none":
        return
    import atexit
    import ctypes
    import threading

    threading._shutdown()  # type: ignore[attr-defined]  # as Python's exit: threading's exit hooks, then the joins
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # what C++ libraries printed through C's stdio, which os._exit would drop
    os._exit(code)


def _launched_environment() -> ClusterEnvironment:
    from unifit.strategies.environment import ClusterEnvironment, detect

    try:
        return detect()
    except UnifitError:
        return ClusterEnvironment()
