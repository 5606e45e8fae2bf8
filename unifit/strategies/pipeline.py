"""Pipeline parallelism for model-parallel (`pipeline_parallel` stages): the network split by layers over groups
of ranks, micro-batches through torch.distributed.pipelining's schedules (GPipe, 1F1B).

The module's steps stay as written. unifit traces the network they call (a child of the module such as
`self.net`; torch.export, so its forward must be one graph) and splits it at the split points; each rank runs one
stage. A batch is cut into micro-batches (rows along dim 0), and per micro-batch the step runs as written on every
rank, with the network replaced by a stand-in:
- on the last stage, inside the schedule's loss function: the stand-in returns the pipeline's output for the
  micro-batch, so the loss and what the step logs are the step's own (the last stage's ranks report the metrics);
- on the other stages, before the schedule: the stand-in records the network's inputs (stage 0 feeds them to the
  pipeline) and returns zeros shaped as the output, so the step's code runs alike; what it logs is not reported.
A trace is specialised to the shapes of one micro-batch (torch.export), so one is made per shape met (the first
batch, a smaller last one, validation's), each over the same parameters.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch

from unifit.errors import ConfigError
from unifit.strategies.pipeline_blocks import BlockStage, block_bounds, check_chained, evaluating
from unifit.strategies.torch_compat import (
    RECEIVED_ACTIVATIONS_NEED_GRAD,
    flatten_dense,
    set_schedule_backward,
    tree_flatten,
    tree_map_only,
    tree_unflatten,
    unflatten_dense,
    wrap_stage_initialisation,
)

if TYPE_CHECKING:
    from unifit.strategies.pipeline_sharding import ShardedBlocks
    from unifit.strategies.torch_precision import Precision

log = logging.getLogger("unifit")

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def network_and_splits(model: torch.nn.Module, split_points: list[str] | None, stages: int) -> tuple[str, list[str]]:
    """(the child of `model` that the pipeline splits, the split points inside it, relative to it). Without split
    points: the longest list of blocks (ModuleList or Sequential) split evenly. Bad input: one line."""
    where = "trainer.strategy_options.split_points"
    if split_points is None:
        lists = [(name, m) for name, m in model.named_modules() if name and isinstance(m, torch.nn.ModuleList)]
        lists += [(name, m) for name, m in model.named_modules() if name and isinstance(m, torch.nn.Sequential)]
        if not lists:
            raise ConfigError(
                f"{where}: none given and {type(model).__name__} has no ModuleList or Sequential of blocks to split "
                f"evenly; name the {stages - 1} module(s) where stages {', '.join(map(str, range(1, stages)))} begin"
            )
        name, blocks = max(lists, key=lambda pair: len(pair[1]))
        if len(blocks) < stages:
            raise ConfigError(
                f"{where}: none given, and the longest list of blocks in {type(model).__name__} ({name}) has "
                f"{len(blocks)} for {stages} stages; lower pipeline_parallel or name the split points"
            )
        split_points = [f"{name}.{round(i * len(blocks) / stages)}" for i in range(1, stages)]
    if len(split_points) != stages - 1:
        raise ConfigError(
            f"{where}: {len(split_points)} given for pipeline_parallel {stages}; name {stages - 1} (each the "
            "module where a stage begins)"
        )
    modules = dict(model.named_modules())
    for point in split_points:
        if point not in modules:
            near = [n for n, m in modules.items() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]
            raise ConfigError(
                f"{where}: {point!r} names no submodule of {type(model).__name__}; name modules as in "
                f"named_modules() (its lists of blocks: {', '.join(near) or 'none'}; e.g. {near[0] + '.1' if near else 'net.blocks.2'})"
            )
    roots = {point.split(".")[0] for point in split_points}
    root = split_points[0].split(".")[0]
    if len(roots) > 1 or root in split_points:
        raise ConfigError(
            f"{where}: {split_points} must lie inside one submodule the steps call (e.g. net.blocks.2 inside "
            f"self.net), not be it; received points under {sorted(roots)}"
        )
    outside = [n for n, p in model.named_parameters() if not n.startswith(root + ".")]
    if outside:
        raise ConfigError(
            f"{where}: the pipeline splits {root}, but {type(model).__name__} also holds parameters outside it "
            f"({', '.join(outside[:3])}); only the network the steps call can be split: move them into {root}"
        )
    return root, [point[len(root) + 1 :] for point in split_points]


class _Captured(Exception):
    """Raised by the stand-in once it has the network's inputs (the first trace)."""


class _Entry(torch.nn.Module):
    """What the pipeline traces: the network, its output flattened to the tensors in it. The output's structure
    (one tensor, a tuple, transformers' ModelOutput) is kept, so the step gets it back whole; what is not a tensor
    in it (a key/value cache) comes back as None."""

    def __init__(self, network: torch.nn.Module, seen: list[_Structure]) -> None:
        super().__init__()
        self.net = network
        self.seen = seen.append  # what the trace saw, kept outside (torch.export undoes changes to the module)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        leaves, spec = tree_flatten(self.net(*args, **kwargs))
        tensors = tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
        kept = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        self.seen(_Structure(spec, kept, [(tuple(t.shape), t.dtype) for t in tensors]))
        return tensors


@dataclass
class _Structure:
    """The network's output for one micro-batch: its pytree spec, which leaves are tensors, their shapes and dtypes."""

    spec: Any
    kept: list[bool]
    tensors: list[tuple[tuple[int, ...], torch.dtype]]

    def rebuild(self, tensors: Any) -> Any:
        """The output as the network returns it, from the stage's tensors (None where it held something else)."""
        given = iter(tensors if isinstance(tensors, (tuple, list)) else (tensors,))
        return tree_unflatten([next(given) if kept else None for kept in self.kept], self.spec)

    def zeros(self, device: torch.device) -> Any:
        return self.rebuild([torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in self.tensors])


class _Recorder(torch.nn.Module):
    """Stands in for the network where the loss is not computed: records the inputs, returns zeros shaped as the
    output (or stops the step, `output` None, when only the inputs are wanted)."""

    def __init__(self, output: tuple[_Structure, torch.device] | None) -> None:
        super().__init__()
        self.output = output
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        if self.output is None:
            raise _Captured
        structure, device = self.output
        return structure.zeros(device)


class _Given(torch.nn.Module):
    """Stands in for the network on the last stage: the pipeline's output for this micro-batch."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output
        self.calls: list[Any] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(None)
        return self.output


@dataclass
class _Traced:
    stage_module: torch.nn.Module  # this rank's stage of one trace (one micro-batch shape)
    output: _Structure  # the network's output for one micro-batch
    # (training or forward only, micro-batches) -> a schedule over its own PipelineStage (one schedule switched
    # between training and forward only would infer the stage's metadata again at every switch)
    schedules: dict[tuple[bool, int], Any] = field(default_factory=dict)


class Pipeline:
    """One rank's stage of the network and the schedules that run it, per micro-batch shape."""

    def __init__(
        self,
        step_module: Any,
        network: str,
        splits: list[str],
        stage_index: int,
        stages: int,
        group: Any,
        device: torch.device,
        schedule: str,
        microbatches: int,
        speaks: bool,
        builder: str = "auto",
    ) -> None:
        self.module = step_module.module  # the TrainModule (a LightningModule's adapter): its steps and its logging
        self.holder = self.module.state_module  # the nn.Module holding the network as an attribute
        self.network = network
        self.splits = splits
        self.stage_index, self.stages = stage_index, stages
        self.first, self.last = stage_index == 0, stage_index == stages - 1
        self.group, self.device = group, device
        self.schedule = schedule
        self.microbatches = microbatches
        self.speaks = speaks  # this rank logs its stage's layout (the first replica's ranks)
        # how the stages are built: "trace" (torch's tracer), "blocks" (pipeline_blocks.py), or "auto" (the tracer,
        # else the blocks, decided at the first build)
        self.builder = builder
        self._bounds = block_bounds(self.holder.get_submodule(network), splits)
        if builder == "blocks" and self._bounds is None:
            raise ConfigError(
                f"trainer.strategy_options.stages: blocks needs split points that are items of one list of blocks "
                f"(e.g. {network}.layers.2); received {', '.join(f'{network}.{p}' for p in splits)}: name such "
                "points, or set stages: trace"
            )
        self.owned_ids: set[int] = set()  # ids of this stage's parameters and buffers (known from the first trace)
        # parameters several stages hold (tied weights: an embedding and the head reading it), in the network's order
        # on every rank; and those whose gradient norm a lower stage counts
        self.shared: list[torch.nn.Parameter] = []
        self.counted_below: set[int] = set()
        self._shared_shapes: list[torch.Size] = []
        self._unused: set[int] | None = None  # shared parameters no stage computes a gradient for (the first step)
        # the other stages' parameters, released (storage emptied) between traces, each with its stage and shape
        self._others: list[tuple[torch.nn.Parameter, int, torch.Size]] = []
        self._stage_of: dict[int, int] = {}  # every stage-held parameter's id -> the first stage holding it
        self._traced: dict[Any, _Traced] = {}
        self._micro: list[Any] = []
        self._call: tuple[str, int, tuple[Any, ...]] = ("training_step", 0, ())
        self._scale: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []
        self._structure: _Structure | None = None  # the current trace's output
        self.inferring = False  # set while a schedule infers its stage's shapes (see _flag_inference)
        self._trained = False  # a training batch came (the first is checked against the micro-batches)
        self.sharding: ShardedBlocks | None = None  # this stage's blocks sharded over its replicas (FSDP2), if so

    # ---- one batch ------------------------------------------------------------------------
    def run(self, step: str, batch: Any, batch_idx: int, more: tuple[Any, ...], scale: torch.Tensor | None) -> Any:
        """The step over the batch's micro-batches through the pipeline: training (backward included, gradients
        scaled by `scale` / micro-batches) when `scale` is given, else forward only. Returns the batch's mean loss
        on the last stage (training), None elsewhere."""
        try:
            return self._scheduled(step, batch, batch_idx, more, scale)
        finally:  # sharded blocks stay gathered from one micro-batch to the next, not past the batch
            if self.sharding is not None:
                self.sharding.reshard()

    def _scheduled(
        self, step: str, batch: Any, batch_idx: int, more: tuple[Any, ...], scale: torch.Tensor | None
    ) -> Any:
        rows = _rows(batch, step)
        if step == "training_step" and not self._trained and rows % self.microbatches:
            raise ConfigError(
                f"trainer.strategy_options.microbatches: {self.microbatches} does not divide a training batch of "
                f"{rows} rows; set trainer.batch_size to a multiple of {self.microbatches}, or microbatches to a "
                f"divisor of {rows}"
            )
        self._trained = self._trained or step == "training_step"
        count = _microbatches(rows, self.microbatches)
        micro = _split(batch, count)
        traced = self._traced.get(key := _shapes(micro[0]))
        training = scale is not None
        if training and self.sharding is not None:  # a build gathers: every replica of the stage builds, or none
            builds = traced is None or (training, count) not in traced.schedules
            if self.sharding.agree(builds, count, batch_idx):
                traced = None
        if traced is None:
            traced = self._traced[key] = self._build(step, micro[0], batch_idx, more)
        schedule = traced.schedules.get((training, count)) or self._schedule(traced, count, training)
        self._micro, self._call, self._scale, self._losses = micro, (step, batch_idx, more), scale, []
        self._structure = traced.output
        run = schedule.step if training else schedule.eval
        blocks = isinstance(traced.stage_module, BlockStage)  # every stage takes the network's inputs
        inputs: list[torch.Tensor] = []
        if self.last:
            if blocks:
                inputs = _joined([self._inputs(step, each, batch_idx, more) for each in micro])
            named = {f"input{i}": leaf for i, leaf in enumerate(inputs)}
            # the step has the outputs (a loss among them: no merge)
            run(target=torch.arange(count), return_outputs=False, **named)
            return torch.stack(self._losses).mean() if self._losses else None
        recorder = _Recorder((traced.output, self.device))
        with torch.no_grad():
            for each in micro:
                self._user_step(step, each, batch_idx, more, recorder)
        if blocks:
            inputs = _joined(recorder.calls)
            if self.first:
                run(*inputs)
            else:
                run(**{f"input{i}": leaf for i, leaf in enumerate(inputs)})
        elif self.first:
            args = [tree_unflatten(list(parts), spec) for parts, spec in _stacked(recorder.calls)]
            run(*args[0], **args[1])
        else:
            run()
        return None

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: the step as written, on micro-batch `target`."""
        if self.inferring:  # the schedule's first call infers shapes on uninitialised tensors: not a micro-batch
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            return torch.stack([(t * 0).sum() for t in outputs if t.is_floating_point()]).sum()
        step, batch_idx, more = self._call
        assert self._structure is not None  # run() set it
        given = _Given(self._structure.rebuild(output))
        out = self._user_step(step, self._micro[int(target)], batch_idx, more, given)
        if self._scale is None:  # forward only (validation): what the step logged is all
            return torch.zeros((), device=self.device)
        loss = _loss_of(out, step)
        self._losses.append(loss.detach())
        return loss * (self._scale / len(self._micro))

    def _zeroed_while_inferring(self, stage_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """torch 2.13 infers a stage's shapes by running it on uninitialised tensors made for its inputs (past the
        first stage): integer ones (token ids, targets travelling to the last stage) are zeroed then, so that
        indexing with them stays in range. (Keyword inputs are the micro-batch's own, real: left as they are.)"""
        if self.inferring:
            for tensor in tree_flatten(args)[0]:
                if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
                    tensor.zero_()

    def _user_step(self, step: str, batch: Any, batch_idx: int, more: tuple[Any, ...], standin: Any) -> Any:
        holder, collector = self.holder, self.module._unifit_collector
        network, before = getattr(holder, self.network), len(standin.calls)
        setattr(holder, self.network, standin)
        counted = collector.batch_count if collector is not None else None
        if collector is not None:  # what the step logs is weighed by the micro-batch's rows
            collector.batch_count = _rows(batch, step)
        try:
            out = getattr(self.module, step)(batch, batch_idx, *more)
        finally:
            setattr(holder, self.network, network)
            if collector is not None:
                collector.batch_count = counted
        if len(standin.calls) - before != 1:
            raise ConfigError(
                f"{type(self.holder).__name__}.{step} called self.{self.network} {len(standin.calls) - before} times for one "
                f"micro-batch; pipeline parallelism runs the network once per step: call it once (or use fsdp)"
            )
        return out

    # ---- a new micro-batch shape -----------------------------------------------------------
    def _build(self, step: str, micro: Any, batch_idx: int, more: tuple[Any, ...]) -> _Traced:
        """This rank's stage for the micro-batch's shapes: traced, or built from the blocks (`builder`; auto: the
        tracer, else the blocks where the split points allow, decided at the first build on every rank alike)."""
        if self.builder != "blocks":
            try:
                traced = self._trace(step, micro, batch_idx, more)
                self.builder = "trace"
                return traced
            except _Untraced as untraced:
                if self._bounds is None:
                    raise ConfigError(str(untraced)) from None
                self.builder = "blocks"
                if self.speaks and self.stage_index == 0:
                    log.info(
                        "model-parallel: torch's tracer cannot build the stages (%s); they are built from the blocks "
                        "of self.%s.%s instead",
                        str(untraced).removeprefix("trainer.strategy_options.pipeline_parallel: ")[:160],
                        self.network,
                        self._bounds[0],
                    )
        return self._from_blocks(step, micro, batch_idx, more)

    def _from_blocks(self, step: str, micro: Any, batch_idx: int, more: tuple[Any, ...]) -> _Traced:
        import torch.distributed as dist

        example = [_to_host(self._inputs(step, micro, batch_idx, more)) if self.first else None]
        dist.broadcast_object_list(example, group=self.group, group_src=0)
        leaves, spec = tree_flatten(example[0])
        leaves = [leaf.to(self.device) for leaf in leaves]
        network = self.holder.get_submodule(self.network)
        assert self._bounds is not None  # _build checked
        name, bounds = self._bounds
        blocks = network.get_submodule(name)
        stages = [BlockStage(network, blocks, bounds[i], bounds[i + 1], spec) for i in range(self.stages)]
        seen: list[_Structure] = []
        self.materialize()  # the whole network runs once here, for its output's structure
        try:
            with evaluating(network), _quiet("torch._subclasses.fake_tensor"):  # DTensor's failed op: a traceback
                call_args, call_kwargs = tree_unflatten(leaves, spec)
                _Entry(network, seen)(*call_args, **call_kwargs)
            if not self._traced:  # the first build: every weight is rank 0's still
                check_chained(stages, network, leaves, self.network)
            if self.sharding is not None:
                self.sharding.reshard()
        except Exception as exc:
            if isinstance(exc, ConfigError) or not any(_split_by_plan(p) for p in network.parameters()):
                raise
            # this stage's layers split, the others whole: only a split whose pairs stay inside a stage runs so
            raise ConfigError(
                f"trainer.strategy_options.plan: self.{self.network} cannot run with only this stage's layers split "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); a stage hands whole activations on, so "
                "each colwise layer and the rowwise one reading it must lie in one stage: move the split points, or "
                "drop the pair from the plan"
            ) from None
        if not self.owned_ids:
            self.own_blocks()
        self.release()
        stage = stages[self.stage_index]
        if not self.first:
            stage.register_forward_pre_hook(self._zeroed_while_inferring)
        if self.speaks and len(self._traced) == 0:
            log.info(
                "model-parallel: stage %d of %d runs blocks %d-%d of self.%s.%s (and what the network computes "
                "around them)",
                self.stage_index,
                self.stages,
                bounds[self.stage_index],
                bounds[self.stage_index + 1] - 1,
                self.network,
                name,
            )
        return _Traced(stage, seen[-1])

    def _trace(self, step: str, micro: Any, batch_idx: int, more: tuple[Any, ...]) -> _Traced:
        import torch.distributed as dist
        from torch.distributed import pipelining

        example = [_to_meta(self._inputs(step, micro, batch_idx, more)) if self.first else None]
        dist.broadcast_object_list(example, group=self.group, group_src=0)
        # every rank traces with zeros of those shapes, so every rank's trace is the same graph
        args, kwargs = tree_map_only(
            torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=self.device), example[0]
        )
        splits = {f"net.{point}": pipelining.SplitPoint.BEGINNING for point in self.splits}
        network = self.holder.get_submodule(self.network)
        seen: list[_Structure] = []
        entry = _Entry(network, seen)  # its parameters are the network's, named "net." + the network's own names
        self.materialize()  # a trace needs every parameter's shape (not its values)
        try:
            pipe = self._traced_pipe(entry, network, splits, args, kwargs)
            failure = None
        except ConfigError as refused:
            failure = refused
        if self.builder == "auto":  # every rank learns whether any stage failed: all build the same way
            flag = torch.tensor([0.0 if failure is None else 1.0], device=self.device)
            dist.all_reduce(flag, group=self.group)
            if flag.item():
                raise _Untraced(str(failure) if failure else "another stage's trace failed")
        if failure is not None:
            raise failure
        stage_module = pipe.get_stage_module(self.stage_index)
        if not self.first:
            stage_module.register_forward_pre_hook(self._zeroed_while_inferring)
        if not self.owned_ids:
            self.owned_ids = {id(t) for t in (*stage_module.parameters(), *stage_module.buffers())}
            self._find_shared(
                [{id(p) for p in pipe.get_stage_module(i).parameters()} for i in range(self.stages)], entry
            )
        self.release()
        if self.speaks and len(self._traced) == 0:
            log.info(
                "model-parallel: stage %d of %d holds %d of the %d parameter tensors of %s",
                self.stage_index,
                self.stages,
                len(list(stage_module.parameters())),
                len(list(network.parameters())),
                self.network,
            )
        return _Traced(stage_module, seen[-1])  # the trace ran the forward

    def _traced_pipe(self, entry: _Entry, network: torch.nn.Module, splits: Any, args: Any, kwargs: Any) -> Any:
        """torch's pipeline of the network, its stages checked (each rank checks every stage: all refuse alike)."""
        from torch.distributed import pipelining

        copying = network.register_forward_pre_hook(_copied_inputs, with_kwargs=True)
        try:
            with warnings.catch_warnings(), _unpatched(network, self.splits):
                warnings.simplefilter("ignore", FutureWarning)  # torch.export's own deprecation notices
                pipe = pipelining.pipeline(entry, mb_args=tuple(args), mb_kwargs=kwargs, split_spec=splits)
        except Exception as exc:
            raise ConfigError(
                f"trainer.strategy_options.pipeline_parallel: {type(network).__name__} (self.{self.network}) cannot "
                f"be traced as one graph by torch.export ({type(exc.__cause__ or exc).__name__}: "
                f"{str(exc.__cause__ or exc).splitlines()[0][:200]}); remove data-dependent Python control flow from "
                "its forward, or use fsdp"
            ) from None
        finally:
            copying.remove()
        if pipe.num_stages != self.stages:
            raise ConfigError(
                f"trainer.strategy_options.split_points: the trace of self.{self.network} has {pipe.num_stages} "
                f"stages for pipeline_parallel {self.stages}; name points its forward passes through, in order"
            )
        for each in range(self.stages):
            _check_calls(pipe.get_stage_module(each), each, self.network)
        if RECEIVED_ACTIVATIONS_NEED_GRAD and any(
            _takes_integers(pipe.get_stage_module(i)) for i in range(1, self.stages)
        ):
            raise ConfigError(
                f"trainer.strategy_options.pipeline_parallel: torch {torch.__version__}'s pipeline shape inference "
                "cannot pass integer tensors from stage to stage (the targets travelling to the loss on the last "
                "stage: 'only Tensors of floating point dtype can require gradients'); set stages: blocks, or use "
                "torch 2.13 or later"
            )
        for each in range(self.stages):  # every stage's, so that each rank knows which stages hold a tied weight
            _rebind(pipe.get_stage_module(each), entry)
            self._check_shared(pipe.get_stage_module(each), entry)
        return pipe

    def _schedule(self, traced: _Traced, count: int, training: bool) -> Any:
        from torch.distributed import pipelining

        stage = pipelining.PipelineStage(
            traced.stage_module, self.stage_index, self.stages, self.device, group=self.group
        )
        # 1F1B needs a micro-batch per stage at least: a batch of fewer rows (the last, short one) runs GPipe, which
        # computes the same, in another order
        kind = getattr(pipelining, SCHEDULES[self.schedule if count >= self.stages else "gpipe"])
        schedule = traced.schedules[training, count] = kind(stage, count, loss_fn=self._loss, scale_grads=False)
        set_schedule_backward(schedule, training)
        if self.sharding is not None:
            self.sharding.drive(stage)
        _flag_inference(schedule, self)
        return schedule

    def _find_shared(self, held: list[set[int]], network: torch.nn.Module) -> None:
        """`held`: the ids of the tensors each stage holds."""
        for parameter in network.parameters():
            stages = [i for i, ids in enumerate(held) if id(parameter) in ids]
            if stages:
                self._stage_of[id(parameter)] = stages[0]
            if stages and self.stage_index not in stages:
                self._others.append((parameter, stages[0], parameter.shape))
        self.shared = [p for p in network.parameters() if sum(id(p) in ids for ids in held) > 1]
        self._shared_shapes = [local(p).shape for p in self.shared]
        below = set().union(*held[: self.stage_index]) if self.stage_index else set()
        self.counted_below = {id(p) for p in self.shared if id(p) in below}
        if self.shared and self.speaks and self.stage_index == 0:
            log.info(
                "model-parallel: %d parameter(s) held by several stages (%s): their gradients are summed over the "
                "stages",
                len(self.shared),
                "the network's outside its blocks" if self.builder == "blocks" else "tied weights",
            )

    def sum_shared_gradients(self) -> None:
        """A tied weight's gradient is the sum of what each stage holding it computed: summed over the stages
        (one all-reduce; stages that do not hold it add zeros and keep none). One that no stage computed a gradient
        for at the first step (a weight the forward does not use) keeps none, as in one process (the optimizer
        skips it): counted once, so no step waits on the host after."""
        import torch.distributed as dist

        if not self.shared:
            return
        mine = [  # a tensor-parallel one's local shard: the stages' ranks of one tensor-parallel place hold the same
            local(_placed_as(p, p.grad))
            if id(p) in self.owned_ids and p.grad is not None
            else torch.zeros(shape, dtype=p.dtype, device=p.device)
            for p, shape in zip(self.shared, self._shared_shapes)  # a stage without it holds it released
        ]
        if self._unused is None:
            had = [float(id(p) in self.owned_ids and p.grad is not None) for p in self.shared]
            counts = torch.tensor(had, device=mine[0].device)
            dist.all_reduce(counts, group=self.group)
            self._unused = {id(p) for p, count in zip(self.shared, counts.tolist()) if not count}
        flat = flatten_dense(mine)
        dist.all_reduce(flat, group=self.group)
        for parameter, summed in zip(self.shared, unflatten_dense(flat, mine)):
            if id(parameter) in self.owned_ids:
                parameter.grad = None if id(parameter) in self._unused else _shaped_like(parameter, summed)

    def this_stages(self, plan: dict[str, Any]) -> dict[str, Any]:
        """The entries of a tensor-parallel plan (names in the module holding the network) this rank's stage holds:
        those outside the other stages' blocks."""
        assert self._bounds is not None  # tensor parallelism builds from the blocks (checked at __init__)
        name, bounds = self._bounds
        start, end = bounds[self.stage_index], bounds[self.stage_index + 1]
        others = [
            ".".join(p for p in (self.network, name, str(i)) if p) for i in range(bounds[-1]) if not start <= i < end
        ]
        return {k: v for k, v in plan.items() if not any(k == o or k.startswith(o + ".") for o in others)}

    @property
    def built(self) -> bool:
        """Whether a stage was built (the first batch came)."""
        return bool(self._traced)

    def own_blocks(self) -> None:
        """Which tensors each stage holds (stages built from the blocks): its blocks, and every tensor outside them.
        Known before any batch where the blocks are sharded, as their shards: a first build may come inside a
        validation that holds them gathered, when the module's parameters are not the shards."""
        assert self._bounds is not None  # checked at __init__ for stages: blocks
        network = self.holder.get_submodule(self.network)
        name, bounds = self._bounds
        blocks = list(network.get_submodule(name))
        tensors = lambda modules: {id(t) for m in modules for t in (*m.parameters(), *m.buffers())}  # noqa: E731
        per_stage = [tensors(blocks[bounds[i] : bounds[i + 1]]) for i in range(self.stages)]
        outside = tensors([network]) - set().union(*per_stage)
        held = [ids | outside for ids in per_stage]
        self.owned_ids = held[self.stage_index]
        self._find_shared(held, network)

    def this_blocks(self) -> list[torch.nn.Module]:
        """This stage's blocks (stages built from the blocks)."""
        assert self._bounds is not None  # checked at __init__ for stages: blocks
        name, bounds = self._bounds
        blocks = self.holder.get_submodule(self.network).get_submodule(name)
        return list(blocks)[bounds[self.stage_index] : bounds[self.stage_index + 1]]

    # ---- the other stages' weights ---------------------------------------------------------
    def release(self) -> None:
        """The other stages' weights take no memory here (this rank never computes with them)."""
        for parameter, _, _ in self._others:
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)

    def materialize(self) -> None:
        """The other stages' parameters at their shapes again (uninitialised: a trace or a load fills them)."""
        for parameter, _, shape in self._others:
            if parameter.shape != shape:
                parameter.data = torch.empty(shape, dtype=parameter.dtype, device=parameter.device)

    def gather_whole(self, first_rank_of: Any, was: dict[int, int] | None = None) -> None:
        """Every rank's network whole again, as trained (after fit: the module as ddp leaves it): each parameter
        from the first rank of the first stage holding it (`first_rank_of(stage)`), one broadcast each. `was`: the
        ids of parameters that replaced split ones (gathered whole), to the ids they replaced."""
        import torch.distributed as dist

        self.materialize()
        network = self.holder.get_submodule(self.network)
        for parameter in network.parameters():
            stage = self._stage_of.get((was or {}).get(id(parameter), id(parameter)))
            if stage is not None:  # a parameter no stage computes with is rank 0's everywhere already
                dist.broadcast(parameter.data, src=first_rank_of(stage))
        self._others = []

    def _inputs(self, step: str, micro: Any, batch_idx: int, more: tuple[Any, ...]) -> Any:
        """What the step passes the network, (args, kwargs) (its first call, nothing logged)."""
        recorder = _Recorder(None)
        with _muted(self.module), torch.no_grad(), contextlib.suppress(_Captured):
            self._user_step(step, micro, batch_idx, more, recorder)
        if not recorder.calls:
            raise ConfigError(
                f"{type(self.holder).__name__}.{step} did not call self.{self.network}; pipeline parallelism splits "
                "the network the steps call"
            )
        leaves, _ = tree_flatten(recorder.calls[0])
        if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            kinds = sorted({type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)})
            raise ConfigError(
                f"{type(self.holder).__name__}.{step} passes self.{self.network} {', '.join(kinds)} arguments; under "
                "pipeline parallelism the network takes tensors only (their rows are the micro-batch's)"
            )
        return recorder.calls[0]

    def _check_shared(self, stage_module: torch.nn.Module, network: torch.nn.Module) -> None:
        """The stage must compute with the network's own parameters (the optimizer's, the checkpoint's). Its buffers
        are the network's where named as one (_rebind); others are constants the forward makes, which the trace
        lifts (a transformers attention's `lifted_tensor_0`)."""
        mine = {id(t) for t in network.parameters()}
        copied = [name for name, t in stage_module.named_parameters() if id(t) not in mine]
        if copied:
            raise ConfigError(
                f"trainer.strategy_options.pipeline_parallel: the trace of self.{self.network} copied its parameters "
                f"({', '.join(name.removeprefix('net.') for name in copied[:3])}), so its stages would train copies; "
                "use fsdp for this model"
            )


class _Untraced(ConfigError):
    """torch's tracer could not build runnable stages on some rank (builder auto: the blocks may)."""


class PipelinedStep(torch.nn.Module):
    """The step module under pipeline parallelism: a training step runs forward and backward in the schedule,
    started by backward (the loss returned first stands for the batch's and is filled in then); other steps run
    forward only, at once."""

    def __init__(self, step_module: Any, pipeline: Pipeline) -> None:
        super().__init__()
        self.step_module = step_module
        self.pipeline = pipeline
        self._pending: tuple[Any, int, tuple[Any, ...], torch.Tensor] | None = None

    def forward(self, batch: Any, batch_idx: int, *more: Any, step: str = "training_step") -> Any:
        if step != "training_step":
            return self.pipeline.run(step, batch, batch_idx, more, None)
        loss = torch.ones((), device=self.pipeline.device, requires_grad=True)  # the batch's, once run
        self._pending = (batch, batch_idx, more, loss)
        return loss

    def backward(self, scaled: torch.Tensor, precision: Precision) -> None:
        """`scaled`: the engine's loss / accumulation, i.e. the gradient scale (the loss stands at 1 until run)."""
        if self._pending is None:
            raise ConfigError("pipeline parallelism: backward without a training step before it")
        batch, batch_idx, more, loss = self._pending
        self._pending = None
        with precision.autocast():
            mean = self.pipeline.run("training_step", batch, batch_idx, more, scaled.detach())
        if mean is not None:
            loss.data.copy_(mean)


def _flag_inference(schedule: Any, pipeline: Pipeline) -> None:
    """`pipeline.inferring` while the schedule infers its stage's shapes and gradients (its first step), which
    calls the loss function once on tensors that are not a micro-batch's (torch 2.13; 2.11 infers
    without it)."""

    def flagged(infer: Any) -> Any:
        def flagging(*args: Any, **kwargs: Any) -> Any:
            pipeline.inferring = True
            try:
                return infer(*args, **kwargs)
            finally:
                pipeline.inferring = False

        return flagging

    wrap_stage_initialisation(schedule, flagged)


def _takes_integers(stage_module: torch.nn.Module) -> bool:
    """Whether a traced stage receives an integer tensor from the stage before (a target, token ids)."""
    graph = getattr(stage_module, "graph", None)
    values = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"] if graph is not None else []
    return any(isinstance(v, torch.Tensor) and not v.is_floating_point() for v in values)


def _check_calls(stage_module: torch.nn.Module, index: int, network: str) -> None:
    """torch's tracer keeps the network's submodules as graphs of their own; with some networks (transformers'
    Llama: its rotary embedding) a stage calls one without the inputs its graph takes, which would fail at the
    first step. Refused here, in one line."""
    for name, module in stage_module.named_modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if isinstance(graph, torch.fx.Graph) else ():
            called = module.get_submodule(node.target) if node.op == "call_module" else None
            inner = getattr(called, "graph", None)
            if not isinstance(inner, torch.fx.Graph):
                continue
            wanted = [n.target for n in inner.nodes if n.op == "placeholder" and not str(n.target).startswith("*")]
            if len(node.args) + len(node.kwargs) < len(wanted):
                where = ".".join(part for part in (network, name.removeprefix("net").lstrip(".")) if part)
                raise ConfigError(
                    f"trainer.strategy_options.pipeline_parallel: torch's pipeline tracer split self.{network} into "
                    f"stages that cannot run (stage {index}: self.{where} calls self.{where}.{node.target} without "
                    f"the inputs {wanted} of its traced graph); split it with tensor_parallel (a transformers model: "
                    "plan: auto) or fsdp instead"
                )


def _copied_inputs(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
    """The network's inputs copied as it starts (in the trace only), so that each one enters stage 0 and travels on
    with the activations: torch's traced stages take the batch's inputs on the first stage only, so a transformers
    model's `labels`, read by its loss at the end, would not reach the last stage. (A copy made before the network's
    call, outside it, breaks torch's split of the network's module calls.)"""
    return tree_map_only(torch.Tensor, torch.clone, (args, kwargs))


def _rebind(stage_module: torch.nn.Module, network: torch.nn.Module) -> None:
    """The trace copies a parameter that several stages use (a tied weight): each stage computes with the
    network's own again, found by name, so the optimizer steps it and the checkpoint holds it."""
    own = {id(t) for t in (*network.parameters(), *network.buffers())}
    named = [("_parameters", *pair) for pair in stage_module.named_parameters(remove_duplicate=False)]
    named += [("_buffers", *pair) for pair in stage_module.named_buffers(remove_duplicate=False)]
    for kind, name, tensor in named:
        if id(tensor) in own:
            continue
        prefix, _, attribute = name.rpartition(".")
        try:
            original = network.get_parameter(name) if kind == "_parameters" else network.get_buffer(name)
        except AttributeError:
            continue  # not the network's: _check_shared refuses the trace
        getattr(stage_module.get_submodule(prefix), kind)[attribute] = original


@contextlib.contextmanager
def _unpatched(network: torch.nn.Module, splits: list[str]) -> Iterator[None]:
    """pipeline() marks each split point by replacing its module's forward; put them back after the trace (the
    network runs whole elsewhere, and a second trace would wrap the wrapper)."""
    try:
        yield
    finally:
        for point in splits:
            module = network.get_submodule(point)
            for patched in ("forward", "_orig_forward"):
                module.__dict__.pop(patched, None)


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """A torch logger silenced for a moment (what it would log, unifit reports in one line)."""
    quieted = logging.getLogger(logger)
    level = quieted.level
    quieted.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        quieted.setLevel(level)


def _muted(module: Any) -> contextlib.AbstractContextManager[Any]:
    @contextlib.contextmanager
    def muted() -> Iterator[None]:
        collector = module._unifit_collector
        module._unifit_collector = None
        try:
            yield
        finally:
            module._unifit_collector = collector

    return muted()


def _split_by_plan(parameter: Any) -> bool:
    """A parameter the tensor-parallel plan split (a DTensor over a tensor-parallel mesh; not an FSDP shard)."""
    from torch.distributed.tensor import DTensor

    return isinstance(parameter, DTensor) and "tensor_parallel" in (parameter.device_mesh.mesh_dim_names or ())


def _rows(batch: Any, step: str) -> int:
    sizes = {t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ConfigError(
            f"{step}: pipeline parallelism cuts a batch into micro-batches by rows, but its tensors have "
            f"{'no rows' if not sizes else 'different row counts ' + str(sorted(sizes))}; give batches of tensors "
            "with the samples along dim 0"
        )
    return sizes.pop()


def _microbatches(rows: int, wanted: int) -> int:
    """The most micro-batches (at most `wanted`) that cut `rows` into equal parts (equal parts: the mean of their
    means is the batch's mean)."""
    return max(n for n in range(1, min(wanted, rows) + 1) if rows % n == 0)


def _split(batch: Any, count: int) -> list[Any]:
    leaves, spec = tree_flatten(batch)
    parts = [torch.tensor_split(t, count) if isinstance(t, torch.Tensor) else [t] * count for t in leaves]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(count)]


def _shapes(batch: Any) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in tree_flatten(batch)[0])


def _stacked(calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[tuple[list[torch.Tensor], Any]]:
    """The recorded inputs of each micro-batch joined along dim 0: (leaves, spec) for the args, then the kwargs."""
    out = []
    for position in range(2):
        flat = [tree_flatten(call[position]) for call in calls]
        spec = flat[0][1]
        out.append(([torch.cat(parts) for parts in zip(*(leaves for leaves, _ in flat))], spec))
    return out


def local(tensor: Any) -> Any:
    """A tensor-parallel (DTensor) tensor's shard on this rank; a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():  # the shard itself (under autograd: a view that refuses in-place writes)
        return tensor.to_local()


def _placed_as(parameter: Any, grad: Any) -> Any:
    """A tensor-parallel gradient placed as its parameter (an embedding's comes back partial, say: each stage's
    must be the same shards to be summed)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(parameter.placements):
        return grad
    with torch.no_grad():
        return grad.redistribute(parameter.device_mesh, parameter.placements)


def _shaped_like(parameter: Any, shard: torch.Tensor) -> Any:
    """`shard` as the parameter's gradient: a DTensor placed as the parameter where it is one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(parameter, DTensor):
        return shard
    with torch.no_grad():
        return DTensor.from_local(
            shard,
            parameter.device_mesh,
            parameter.placements,
            run_check=False,
            shape=parameter.shape,
            stride=parameter.stride(),
        )


def _joined(calls: list[Any]) -> list[torch.Tensor]:
    """The recorded network calls' (args, kwargs) of each micro-batch, flattened, each leaf joined along dim 0."""
    return [torch.cat(parts) for parts in zip(*(tree_flatten(call)[0] for call in calls))]


def _to_meta(tree: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), tree)


def _to_host(tree: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), tree)


def _loss_of(out: Any, step: str) -> torch.Tensor:
    loss = out["loss"] if isinstance(out, dict) and "loss" in out else out
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"{step} returned {type(out).__name__}; return the loss tensor or a dict with key 'loss'")
    return loss
