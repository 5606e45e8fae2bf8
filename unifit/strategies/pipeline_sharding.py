"""A pipeline stage's blocks sharded over the stage's data-parallel ranks with FSDP2 (torchtitan's layout).

torch's pipelining drives FSDP itself only for a stage whose own module is the FSDP module; unifit's stage module
holds the whole network (pipeline_blocks.BlockStage) and shards only this stage's blocks, so this does it:

- gradients accumulate unreduced over the batch's micro-batches and are reduce-scattered in the last one's backward
  (the schedule says which backward is the last: `PipelineStage.backward_maybe_with_nosync(last_backward=...)`);
- a schedule infers its stage's shapes by running it once (torch 2.13), then clears FSDP modules' `.grad` and
  reshards them: inside an accumulation window that dropped the gradients of the batches before, silently. Only
  the inference's own tensors are freed here (its backward is `autograd.grad` of the inputs: no parameter grads);
- that inference and the pass that builds a stage run FSDP's gathers, collectives of the stage's replicas: a
  replica meeting a new batch shape alone would wait for peers that never come. In training, the replicas agree
  on every batch whether any builds, and then every one builds for its own shape; through validation (uneven
  shards, shapes of their own) the blocks stay gathered, so a forward gathers nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from unifit.errors import ConfigError
from unifit.strategies.torch_compat import free_inference_metadata, replace_inference_cleanup


class ShardedBlocks:
    """This stage's FSDP2 blocks and the data-parallel group that shards them."""

    def __init__(self, blocks: list[torch.nn.Module], group: Any, device: torch.device) -> None:
        self.blocks, self.group, self.device = blocks, group, device
        self.held = False  # gathered through a validation (held_gathered)

    def drive(self, stage: Any) -> None:
        """`stage` (a PipelineStage of this rank): its blocks reduce in the last micro-batch's backward only, and its
        shape inference leaves their gradients and shards alone."""
        backward = stage.backward_maybe_with_nosync

        def each_backward(backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False) -> Any:
            for block in self.blocks:
                block.set_requires_gradient_sync(last_backward, recurse=False)
                block.set_reshard_after_backward(last_backward, recurse=False)
            return backward(backward_type, bwd_kwargs, last_backward=last_backward)

        stage.backward_maybe_with_nosync = each_backward
        replace_inference_cleanup(stage, lambda: free_inference_metadata(stage))

    def agree(self, builds: bool, microbatches: int, batch_idx: int) -> bool:
        """Whether this rank or another replica of its stage builds a stage or schedule for this training batch (a
        collective of the replicas, once a batch). Each block gathers once per micro-batch: replicas cutting their
        batches into different numbers of micro-batches (batches of different row counts) would not pair their
        gathers, so that is refused."""
        import torch.distributed as dist

        agreed = torch.tensor([int(builds), microbatches, -microbatches], device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        anyone, most, fewest = agreed.tolist()
        if most != -fewest:
            raise ConfigError(
                f"trainer.strategy_options.stages: training batch {batch_idx} is cut into {-fewest} micro-batches on "
                f"one replica of a stage and {most} on another (batches of different row counts); blocks sharded over "
                "the replicas gather once per micro-batch, so every replica needs the same count: give batches of "
                "equal rows (a fixed batch size; a batch sampler of varying sizes differs), or stages: trace "
                "(replicas held whole) without tensor_parallel"
            )
        return bool(anyone)

    def reshard(self) -> None:
        """The blocks back to their shards (after a batch: what the optimizer steps and a checkpoint holds), unless
        held gathered through a validation."""
        if not self.held:
            for block in self.blocks:
                block.reshard()

    @contextlib.contextmanager
    def held_gathered(self) -> Iterator[None]:
        """The blocks gathered once, by every rank together, and kept so until the end (a validation)."""
        from unifit.strategies.fsdp import gathered_through

        with gathered_through(self.blocks):
            self.held = True
            try:
                yield
            finally:
                self.held = False
