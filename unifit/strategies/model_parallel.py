"""Tensor parallelism combined with FSDP2 on one DeviceMesh (torchtitan's and Lightning's ModelParallelStrategy's layout).

The world is a 2-D mesh, `data_parallel` x `tensor_parallel` (tensor-parallel groups are consecutive ranks, so
they sit inside a host). Each tensor-parallel group holds one model replica split inside its layers
(torch.distributed.tensor.parallel: Linear and Embedding weights split by columns or rows); the replicas are
sharded over the data-parallel dimension with FSDP2, as fsdp does over the whole world. What follows:
- the data, the learning-rate scaling and the logged values go by replicas (`data_parallel_size`), not ranks:
  the ranks of one tensor-parallel group take the same batches and their logged values count once;
- the split is the module's own (`configure_model()` with `self.device_mesh`, as written for Lightning's
  ModelParallelStrategy) or unifit's from a plan in the YAML (module names -> colwise / rowwise / colwise_gather,
  and sequence parallelism: sequence_parallel.py);
  unifit shards with FSDP2 what the module's configure_model did not;
- clipping takes the norm over every shard of every mesh; checkpoints are DCP's (fsdp's), so they resume on
  another layout (this one at another size, fsdp, or one process).
With `pipeline_parallel` P the mesh gets a third, outermost dimension: the network is split by layers into P
stages over consecutive blocks of ranks, micro-batches run through torch.distributed.pipelining's schedules
(pipeline.py; the strategy's training hooks under stages: pipeline_training.py), and the data-parallel ranks of a
stage hold replicas of it: stages built from the blocks shard each block over them (FSDP2), traced stages' replicas
hold it whole (gradients averaged, as ddp). With both, a stage's layers are split over its
tensor-parallel ranks by the plan (the stages built from the network's blocks: pipeline_blocks.py), each rank
handing its activations to the rank of the same tensor-parallel place in the next stage (torchtitan's 3-D layout).
"""

from __future__ import annotations

import fnmatch
import logging
import sys
from typing import TYPE_CHECKING, Any, ContextManager, Literal

from pydantic import Field, PositiveInt, model_validator

from unifit.errors import ConfigError
from unifit.strategies.block_functions import applies_to_blocks, prepare_blocks
from unifit.strategies.fsdp import FSDPOptions, FSDPStrategy
from unifit.strategies.pipeline_training import PipelineTraining
from unifit.strategies.sequence_parallel import SEQUENCE_DIM, gathers_sequence, on_sequence_shards, refuses_mixed
from unifit.strategies.torch_device import torch_device

if TYPE_CHECKING:
    from unifit.config.schema import TrainerConfig

log = logging.getLogger("unifit")

Style = Literal["colwise", "rowwise", "colwise_gather", "sequence", "rowwise_sequence"]
SEQUENCE_STYLES = ("sequence", "rowwise_sequence")  # sequence parallelism (sequence_parallel.py)
DIMS = ("data_parallel", "tensor_parallel")
PIPELINE_DIMS = ("pipeline_parallel", *DIMS)  # with pipeline stages: the outermost dimension


class ModelParallelOptions(FSDPOptions):
    """trainer.strategy_options for model-parallel (and fsdp's, which shard over the data-parallel ranks)."""

    sharding: Literal["full"] = Field("full", description="the data-parallel ranks shard each replica fully (FSDP2)")
    tensor_parallel: Literal["auto"] | PositiveInt = Field(
        1,
        description="ranks that split each layer of one model replica (consecutive ranks: keep them inside a host); "
        "must divide the world size; the other dimension is data parallel. auto: every rank of a node (Lightning's "
        "ModelParallelStrategy default), so the nodes hold the replicas",
    )
    data_parallel: Literal["auto"] | PositiveInt = Field(
        "auto", description="the model replicas: world size / tensor_parallel (auto), or that number, checked"
    )
    pipeline_parallel: PositiveInt = Field(
        1,
        description="stages the network is split into by layers (consecutive blocks of ranks; the data-parallel "
        "ranks of a stage hold replicas of it); must divide the world size with tensor_parallel",
    )
    split_points: list[str] | None = Field(
        None,
        description="pipeline: module names (as in named_modules(), inside the network the steps call, e.g. "
        "net.blocks.2) where stages 1, 2, ... begin; none: the longest ModuleList or Sequential split evenly",
    )
    stages: Literal["auto", "trace", "blocks"] = Field(
        "auto",
        description="pipeline: how the stages are built. trace: torch's pipeline tracer (torch.export; each stage "
        "holds its own layers only). blocks: from the network's own blocks (the split points must be items of one "
        "list of blocks): every stage runs the network's code around the blocks and holds its weights outside them, "
        "which any forward allows (transformers' Llama). auto: trace, else blocks where the tracer cannot",
    )
    schedule: Literal["gpipe", "1f1b"] = Field(
        "1f1b",
        description="pipeline: gpipe (every micro-batch forward, then backward) or 1f1b (interleaved: less memory)",
    )
    microbatches: PositiveInt | None = Field(
        None,
        description="pipeline: micro-batches per training batch (default: pipeline_parallel); trainer.batch_size "
        "must be a multiple; a smaller last or validation batch is cut into the most equal parts up to it",
    )
    plan: dict[str, Style] | Literal["auto"] | None = Field(
        None,
        description="the split, where the module's configure_model() does not make it. auto: the model's own plan "
        "(a Hugging Face transformers model's tensor-parallel plan, `_tp_plan`, as transformers applies it). Or "
        "module name (as in "
        "named_modules(); * matches one name part, e.g. model.blocks.*.attn.q) -> colwise (output features "
        "split: feed a rowwise), rowwise (input features split, output summed: after a colwise; an Embedding "
        "splits its vocabulary) or colwise_gather (output features split, then gathered: an output head). "
        "Only Linear and Embedding layers split; reshape attention heads with -1, not a fixed head count. "
        "Sequence parallelism: rowwise_sequence (a rowwise whose output goes out cut along the sequence, "
        "dimension 1) and sequence (a module that works per token, run on sequence shards: a norm, dropout, or a "
        "whole block so its residual adds do); a colwise layer gathers such an input whole (see "
        "docs/strategies/model-parallel.md)",
    )

    @model_validator(mode="after")
    def _no_model_parallel_on_shared_gpus(self) -> ModelParallelOptions:
        if self.share_gpus and self.tensor_parallel != 1:
            raise ValueError(
                f"share_gpus with tensor_parallel {self.tensor_parallel}: torch's DTensor collectives over gloo on "
                "CUDA tensors end in a segfault (pytorch#152645; seen with torch 2.11 on an H100), so tensor "
                "parallelism needs one GPU per rank (nccl); share_gpus runs fsdp, ddp and smddp-like"
            )
        if self.share_gpus and self.pipeline_parallel != 1:
            raise ValueError(
                f"share_gpus with pipeline_parallel {self.pipeline_parallel}: gloo cannot send CUDA tensors from "
                "stage to stage ('writev: Bad address', seen with torch 2.11 on an H100), so pipeline stages need "
                "one GPU per rank (nccl); share_gpus runs fsdp, ddp and smddp-like"
            )
        return self

    @model_validator(mode="after")
    def _pipeline_options(self) -> ModelParallelOptions:
        if self.pipeline_parallel == 1:
            given = [n for n in ("split_points", "microbatches") if getattr(self, n) is not None]
            given += ["stages"] if self.stages != "auto" else []
            if given:
                raise ValueError(f"{', '.join(given)} split a pipeline: set pipeline_parallel above 1, or drop them")
        elif isinstance(self.plan, dict) and set(self.plan.values()) & set(SEQUENCE_STYLES):
            raise ValueError(
                f"pipeline_parallel {self.pipeline_parallel} with a sequence-parallel plan (sequence / "
                "rowwise_sequence): stages hand whole activations on, sequence parallelism inside stages is not "
                "built; use rowwise instead of rowwise_sequence and drop the sequence entries, or pipeline_parallel"
            )
        elif self.tensor_parallel != 1 and self.stages == "trace":
            raise ValueError(
                f"pipeline_parallel {self.pipeline_parallel} with tensor_parallel {self.tensor_parallel} and stages: "
                "trace: tensor parallelism splits the layers of stages built from the blocks; set stages: blocks "
                "(or auto)"
            )
        return self


class ModelParallelStrategy(PipelineTraining, FSDPStrategy):
    """Tensor parallelism inside groups of ranks, FSDP2 over the groups: one DeviceMesh (data_parallel, tensor_parallel)."""

    name = "model-parallel"
    Options = ModelParallelOptions
    _block_config: TrainerConfig | None = None  # what applies to the blocks, in wrap_module after the split

    @property
    def tensor_parallel(self) -> int:
        wanted = self.options.tensor_parallel
        return self.env.local_world_size if wanted == "auto" else wanted

    @property
    def pipeline_parallel(self) -> int:
        return self.options.pipeline_parallel

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def data_parallel_rank(self) -> int:
        return (self.rank // self.tensor_parallel) % self.data_parallel_size

    @property
    def stage_index(self) -> int:
        """This rank's pipeline stage (0 without a pipeline)."""
        return self.rank // (self.tensor_parallel * self.data_parallel_size)

    def reports_metrics(self, rank: int) -> bool:
        """One rank per replica: the first of its tensor-parallel group, on the last pipeline stage (the loss's)."""
        last = rank // (self.tensor_parallel * self.data_parallel_size) == self.pipeline_parallel - 1
        return rank % self.tensor_parallel == 0 and last

    @classmethod
    def check_launch(cls, options: Any, *, world_size: int, nproc_per_node: int, accelerator: str) -> None:
        """The layout against the world `unifit launch` is about to start, before it starts it."""
        super().check_launch(options, world_size=world_size, nproc_per_node=nproc_per_node, accelerator=accelerator)
        tensor = nproc_per_node if options.tensor_parallel == "auto" else options.tensor_parallel
        _check_layout(options, world_size, tensor)

    def setup(self) -> None:
        _check_layout(self.options, self.world_size, self.tensor_parallel)
        super().setup()
        if not self._group_ready():
            return
        from torch.distributed.device_mesh import init_device_mesh

        device = torch_device(self.accelerator, self.device_index)
        shape = (self.data_parallel_size, self.tensor_parallel)
        if self.pipeline_parallel > 1:
            self.device_mesh = init_device_mesh(
                device.type, (self.pipeline_parallel, *shape), mesh_dim_names=PIPELINE_DIMS
            )
        else:
            self.device_mesh = init_device_mesh(device.type, shape, mesh_dim_names=DIMS)
        # gathering a parameter split over both dimensions (the export) takes two all-gathers, which torch warns
        # about on every rank: copies, no reduction, so nothing can differ between ranks
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    def _log_layout(self) -> None:
        if self.pipeline_parallel > 1:
            opts = self.options
            log.info(
                "model-parallel: %d rank(s) = %d pipeline stages x %d data-parallel x %d tensor-parallel (mesh dims "
                "%s; the ranks of a stage are consecutive), schedule %s, %d micro-batches",
                self.world_size,
                self.pipeline_parallel,
                self.data_parallel_size,
                self.tensor_parallel,
                ", ".join(PIPELINE_DIMS),
                opts.schedule,
                opts.microbatches or self.pipeline_parallel,
            )
            return
        log.info(
            "model-parallel: %d rank(s) = %d data-parallel x %d tensor-parallel (mesh dims %s; the ranks of a "
            "tensor-parallel group are consecutive)",
            self.world_size,
            self.world_size // self.tensor_parallel,
            self.tensor_parallel,
            ", ".join(DIMS),
        )

    def teardown(self) -> None:
        if self._pipeline is not None and sys.exc_info()[0] is None:  # a fit that ended well: the module whole
            was = _unsplit(self._pipeline.step_module.module.state_module)
            self._pipeline.pipeline.gather_whole(
                lambda stage: stage * self.data_parallel_size * self.tensor_parallel, was
            )
        self.device_mesh = None
        self._pipeline = None
        super().teardown()

    def _mesh(self, device: Any) -> Any:
        """FSDP2 shards over the data-parallel dimension."""
        return self.device_mesh["data_parallel"]

    def prepare_blocks(self, model: Any, config: TrainerConfig) -> list[str]:
        """Kept for wrap_module: the blocks are checkpointed and compiled after the tensor-parallel split (its plan
        names their layers by path, which the checkpoint wrapper would change), before they are sharded."""
        if applies_to_blocks(config) and self.pipeline_parallel > 1:
            raise ConfigError(
                "trainer.activation_checkpointing / trainer.compile: blocks are not run under pipeline_parallel yet "
                "(the stages are cut from the same blocks); use them with tensor_parallel and fsdp, or turn them off"
            )
        self._block_config = config
        return []

    def _prepare_blocks(self, model: Any) -> None:
        if self._block_config is not None:
            for line in prepare_blocks(model, self._block_config):
                if self.is_global_zero:
                    log.info(line)
            self._block_config = None

    def wrap_module(self, step_module: Any, device: Any) -> Any:
        model = step_module.module.state_module
        if self.pipeline_parallel > 1:
            return self._pipelined(step_module, device)
        plan = _resolved_plan(model, self.options.plan)  # checked at any world size: a wrong name is refused
        if not self._group_ready():
            self._prepare_blocks(model)
            return step_module
        from torch.distributed.fsdp import FSDPModule

        split = _tensor_parallel_meshes(model)
        if plan and split:
            raise ConfigError(
                "trainer.strategy_options.plan: the module's configure_model() split it already; drop the plan "
                "or the split in configure_model()"
            )
        if plan:
            self._split(model, plan)
        elif self.tensor_parallel > 1 and not split:
            raise ConfigError(
                f"trainer.strategy_options.tensor_parallel: {self.tensor_parallel}, but nothing in "
                f"{type(model).__name__} is split (its configure_model() made no DTensor parameters); give "
                "trainer.strategy_options.plan, or split the model in configure_model() with self.device_mesh"
            )
        tp_mesh = self.device_mesh["tensor_parallel"]
        if any(mesh != tp_mesh for mesh in split):
            raise ConfigError(
                "configure_model(): parameters are split over a mesh that is not self.device_mesh['tensor_parallel']; "
                "split over self.device_mesh['tensor_parallel'] (and shard over self.device_mesh['data_parallel'])"
            )
        self._prepare_blocks(model)  # torchtitan's order: tensor parallel, activation checkpointing, fsdp
        if any(isinstance(m, FSDPModule) for m in model.modules()):
            if self.is_global_zero:
                log.info(
                    "model-parallel: configure_model() sharded the model with fully_shard itself; unifit adds none"
                )
            return step_module
        if self.data_parallel_size == 1:
            return step_module
        return super().wrap_module(step_module, device)

    def _split(self, model: Any, plan: dict[str, Style]) -> None:
        """Rank 0's weights on every rank (a single process's start), then each planned layer split over its group."""
        from torch.distributed.tensor.parallel import parallelize_module

        _from_rank_zero(model)
        tp_mesh = self.device_mesh["tensor_parallel"]
        tied = [users for users in _tied(model).values() if any(name in plan for name, _ in users)]
        sequence = bool(set(plan.values()) & set(SEQUENCE_STYLES))
        for name, style in plan.items():
            layer = model.get_submodule(name)
            if style == "sequence":
                on_sequence_shards(layer, tp_mesh)
                continue
            parallelize_module(layer, tp_mesh, _style(style, layer))
            if sequence and style.startswith("colwise"):
                gathers_sequence(layer)
        if sequence:  # torch's refusal of a plain tensor beside sequence shards, in one line naming the module
            entries = [name for name, style in plan.items() if style in SEQUENCE_STYLES]
            holders = {".".join(n.split(".")[:i]) for n in entries for i in range(1, n.count(".") + 2)}
            for name in sorted(holders, key=len, reverse=True):
                refuses_mixed(model.get_submodule(name), name)
        for users in tied:  # each layer got its own split copy: hold the first one's again (_check_tie checked)
            (first, attribute), *others = users
            weight = getattr(model.get_submodule(first), attribute)
            for name, other in others:
                model.get_submodule(name).register_parameter(other, weight)
        if self.is_global_zero:
            counts = {s: sum(1 for v in plan.values() if v == s) for s in sorted(set(plan.values()))}
            log.info(
                "model-parallel: %d layer(s) split over %d ranks (%s)",
                len(plan),
                self.tensor_parallel,
                ", ".join(f"{n} {s}" for s, n in counts.items()),
            )

    def evaluating(self, wrapped: Any, uneven: bool) -> ContextManager[Any]:
        """Stages with sharded blocks keep them gathered through every validation: a replica's batches (their
        number, the last one's shape, so a stage built for it) are its own, and nothing it runs must gather."""
        sharding = self._pipeline.pipeline.sharding if self._pipeline is not None else None
        return sharding.held_gathered() if sharding is not None else super().evaluating(wrapped, uneven)

    # ---- pipeline parallelism -------------------------------------------------------------
    def _shard_blocks(self, blocks: list[Any]) -> None:
        """Stages built from the blocks: each of this stage's blocks sharded over the stage's data-parallel ranks
        (FSDP2: gathered for its forward and backward, its gradients reduce-scattered, its optimizer state 1/D);
        the weights outside the blocks, every stage's, stay replicas (averaged as ddp, summed over the stages)."""
        import functools

        from torch.distributed.fsdp import fully_shard

        from unifit.strategies.fsdp import shard_placement

        mesh = self.device_mesh["data_parallel"]
        for block in blocks:
            fully_shard(
                block,
                mesh=mesh,
                reshard_after_forward=self.options.reshard_after_forward,
                shard_placement_fn=functools.partial(shard_placement, ranks=mesh.size()),
            )
        if self.is_global_zero:
            log.info(
                "model-parallel: each stage's blocks sharded over its %d data-parallel ranks (FSDP2)",
                self.data_parallel_size,
            )

    def _pipelined(self, step_module: Any, device: Any) -> Any:
        """The network split into stages (pipeline.py); every rank starts from rank 0's weights, as one process."""
        from unifit.strategies.pipeline import Pipeline, PipelinedStep, network_and_splits

        model, opts = step_module.module.state_module, self.options
        network, splits = network_and_splits(model, opts.split_points, self.pipeline_parallel)
        if _tensor_parallel_meshes(model):
            raise ConfigError(
                "trainer.strategy_options.pipeline_parallel: configure_model() split the model over tensor-parallel "
                "ranks before the stages are cut; under pipeline stages give the split as trainer.strategy_options."
                "plan (or plan: auto) instead, and unifit splits each stage's layers"
            )
        plan = _resolved_plan(model, opts.plan)
        if "backward" in step_module.module.step_hooks():
            raise ConfigError(
                f"{type(model).__name__} overrides backward(); under pipeline_parallel the schedule runs backward "
                "itself, stage by stage: drop the override, or use fsdp / tensor_parallel"
            )
        _from_rank_zero(model)
        pipeline = Pipeline(
            step_module,
            network,
            splits,
            self.stage_index,
            self.pipeline_parallel,
            self.device_mesh["pipeline_parallel"].get_group(),
            device,
            opts.schedule,
            opts.microbatches or self.pipeline_parallel,
            speaks=self.data_parallel_rank == 0 and self.rank % self.tensor_parallel == 0,
            builder="blocks" if self.tensor_parallel > 1 else opts.stages,
        )
        if self.tensor_parallel > 1:  # this stage's layers (and those around the blocks, every stage's) split
            self._split(model, pipeline.this_stages(plan))
        if self.data_parallel_size > 1 and pipeline.builder == "blocks":
            from unifit.strategies.pipeline_sharding import ShardedBlocks

            blocks = pipeline.this_blocks()
            self._shard_blocks(blocks)
            pipeline.sharding = ShardedBlocks(blocks, self.device_mesh["data_parallel"].get_group(), device)
            pipeline.own_blocks()  # as the shards, before any batch
        if self.is_global_zero:
            log.info(
                "model-parallel: %s split into %d stages at %s (%s schedule)",
                network,
                self.pipeline_parallel,
                ", ".join(f"{network}.{point}" for point in splits),
                opts.schedule,
            )
        self._pipeline = PipelinedStep(step_module, pipeline)
        return self._pipeline


def _unsplit(model: Any) -> dict[int, int]:
    """Each tensor-parallel parameter whole again, a plain one (gathered over its group; a tied one stays one).
    Returns {id of the new parameter: id of the one it replaces}."""
    import torch
    from torch.distributed.tensor import DTensor

    whole: dict[int, Any] = {}
    was: dict[int, int] = {}
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if isinstance(parameter, DTensor):
                if id(parameter) not in whole:
                    gathered = parameter.full_tensor().detach()
                    whole[id(parameter)] = torch.nn.Parameter(gathered, requires_grad=parameter.requires_grad)
                    was[id(whole[id(parameter)])] = id(parameter)
                module.register_parameter(name, whole[id(parameter)])
    return was


def _from_rank_zero(model: Any) -> None:
    """Rank 0's weights and buffers on every rank: a split model starts where one process would."""
    import torch.distributed as dist

    for tensor in model.state_dict().values():
        dist.broadcast(tensor.data, src=0)


# transformers' tensor-parallel styles (its `_tp_plan`) that are unifit's: the same splits of the same layers
TRANSFORMERS_STYLES: dict[str, Style] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "embedding_rowwise": "rowwise",
}


def _models_own_plan(model: Any) -> dict[str, Style]:
    """plan: auto: the tensor-parallel plan of the outermost Hugging Face transformers model inside `model`
    (`_tp_plan`: its patterns under its own name), in unifit's styles; refused in one line where there is none or
    it uses a style unifit does not apply."""
    for prefix, module in model.named_modules():
        own = getattr(module, "_tp_plan", None)
        if isinstance(own, dict) and own:
            plan: dict[str, Style] = {}
            for pattern, style in own.items():
                if style not in TRANSFORMERS_STYLES:
                    raise ConfigError(
                        f"trainer.strategy_options.plan: auto: {type(module).__name__}'s tensor-parallel plan splits "
                        f"{pattern} as {style!r}, which unifit does not apply (it takes {', '.join(TRANSFORMERS_STYLES)}"
                        "); write the plan in the YAML (colwise / rowwise / colwise_gather per layer name)"
                    )
                plan[f"{prefix}.{pattern}" if prefix else pattern] = TRANSFORMERS_STYLES[style]
            return plan
    raise ConfigError(
        f"trainer.strategy_options.plan: auto, but nothing in {type(model).__name__} carries a tensor-parallel "
        "plan (a Hugging Face transformers model's `_tp_plan`); write the plan in the YAML (layer name -> colwise / "
        "rowwise / colwise_gather) or split the model in configure_model()"
    )


def _resolved_plan(model: Any, plan: dict[str, Style] | Literal["auto"] | None) -> dict[str, Style]:
    """The plan with its patterns resolved to module names, each a Linear or an Embedding; a pattern that names
    nothing, or something else, is refused in one line."""
    import torch

    if not plan:
        return {}
    if plan == "auto":
        plan = _models_own_plan(model)
    modules = dict(model.named_modules())
    resolved: dict[str, Style] = {}
    for pattern, style in plan.items():
        names = [n for n in modules if n and _matches(n, pattern)]
        if not names:
            near = [n for n in modules if n and isinstance(modules[n], (torch.nn.Linear, torch.nn.Embedding))][:6]
            raise ConfigError(
                f"trainer.strategy_options.plan: {pattern!r} names no submodule of {type(model).__name__}; "
                f"its Linear/Embedding layers are named like: {', '.join(near) or 'none'}"
            )
        for name in names:
            if style != "sequence" and not isinstance(modules[name], (torch.nn.Linear, torch.nn.Embedding)):
                raise ConfigError(
                    f"trainer.strategy_options.plan: {pattern!r} matches {name}, a {type(modules[name]).__name__}; "
                    "only Linear and Embedding layers split: name those inside it"
                )
            resolved[name] = style
    for users in _tied(model).values():
        if any(name in resolved for name, _ in users):
            _check_tie(users, resolved, modules)
    return resolved


def _tied(model: Any) -> dict[int, list[tuple[str, str]]]:
    """Parameters that several modules hold (tied embeddings): id -> [(module name, attribute)]."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for attribute, parameter in module.named_parameters(recurse=False):
            holders.setdefault(id(parameter), []).append((name, attribute))
    return {key: users for key, users in holders.items() if len({name for name, _ in users}) > 1}


def _check_tie(users: list[tuple[str, str]], plan: dict[str, Style], modules: dict[str, Any]) -> None:
    """A tied weight splits only where every layer holding it is planned and splits it along the same dimension
    (an Embedding's vocabulary split and a head's output split are the same rows): then it stays tied."""
    names = sorted({name for name, _ in users})
    dims = {
        _split_dim(plan[name], modules[name]) if plan.get(name, "sequence") != "sequence" else None for name in names
    }
    if None in dims or len(dims) > 1:
        styles = ", ".join(f"{name} {plan.get(name, 'not split')}" for name in names)
        raise ConfigError(
            f"trainer.strategy_options.plan: {' and '.join(names)} share one weight (tied), which the plan splits "
            f"differently ({styles}); split them so the weight's rows split alike (the Embedding rowwise and the "
            "head colwise or colwise_gather), or untie them"
        )


def _split_dim(style: Style, layer: Any) -> int:
    """The dimension of the layer's weight that `style` splits (a Linear's weight is out x in)."""
    import torch

    rowwise = style.startswith("rowwise")
    if isinstance(layer, torch.nn.Embedding):
        return 0 if rowwise else 1
    return 1 if rowwise else 0


def _matches(name: str, pattern: str) -> bool:
    """`*` matches one dotted name part (model.blocks.*.attn.q), as in torch's parallelize_module."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted))


def _style(style: Style, layer: Any) -> Any:
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    # rowwise_sequence: the sum reduce-scattered along the sequence, kept a DTensor for the sequence-shard modules
    out = {"output_layouts": Shard(SEQUENCE_DIM), "use_local_output": False} if style == "rowwise_sequence" else {}
    if isinstance(layer, torch.nn.Embedding):  # token ids come whole: each rank looks up its part of the vocabulary
        return RowwiseParallel(input_layouts=Replicate(), **out)
    return RowwiseParallel(**out)


def _tensor_parallel_meshes(model: Any) -> list[Any]:
    """The meshes the module's own split (configure_model) put its DTensor parameters on, one per distinct mesh."""
    from torch.distributed.tensor import DTensor

    meshes: list[Any] = []
    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            mesh, names = parameter.device_mesh, parameter.device_mesh.mesh_dim_names or ()
            if "tensor_parallel" in names and mesh.ndim > 1:
                mesh = mesh["tensor_parallel"]
            elif names == ("data_parallel",):
                continue  # sharded by fully_shard only
            if all(mesh != m for m in meshes):
                meshes.append(mesh)
    return meshes


def _check_layout(options: ModelParallelOptions, world_size: int, tensor: int) -> None:
    """tensor x pipeline (x data, where given) must make the world size: a ConfigError saying what to launch."""
    pipeline = options.pipeline_parallel
    split = tensor * pipeline
    if pipeline > 1 and tensor > 1 and not options.plan:  # configure_model() cannot split a stage's layers
        raise ConfigError(
            f"trainer.strategy_options.tensor_parallel: {tensor} with pipeline_parallel {pipeline}, but no plan; give "
            "trainer.strategy_options.plan (module name -> colwise / rowwise / colwise_gather), or plan: auto for a "
            "transformers model"
        )
    if pipeline > 1 and world_size % split:
        raise ConfigError(
            f"trainer.strategy_options: tensor_parallel {tensor} x pipeline_parallel {pipeline} does not divide the "
            f"world size {world_size}; launch a multiple of {split} ranks"
        )
    if world_size % tensor:
        raise ConfigError(
            f"trainer.strategy_options.tensor_parallel: {tensor} does not divide the world size {world_size}; use a "
            f"divisor of {world_size} or launch a multiple of {tensor} ranks"
        )
    wanted = options.data_parallel
    if wanted != "auto" and wanted * split != world_size:
        raise ConfigError(
            f"trainer.strategy_options.data_parallel: {wanted} x tensor_parallel {tensor} x pipeline_parallel "
            f"{pipeline} is not the world size {world_size}; set data_parallel: auto, or launch {wanted * split} ranks"
        )
