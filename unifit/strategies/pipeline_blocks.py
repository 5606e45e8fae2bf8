"""Pipeline stages built from the network's own blocks, where torch's tracer cannot build them (transformers' Llama)
or is not wanted (`stages: blocks`): torchtitan's way of splitting by layers, without editing the model.

Every stage runs the network's forward as written, on the micro-batch's own inputs (each stage gets them), so what
happens around the blocks (embeddings, masks, rotary position tables) is the network's own code on every stage:
- the blocks before the stage pass their input through without computing (their weights are released here);
- the stage's first block takes the activation received from the stage before in place of its input;
- the first block after the stage ends the forward there: its input is what the stage hands on.
The last stage runs on to the network's output. The parameters outside the blocks (an embedding, a head) are held
by every stage; their gradients are summed over the stages (the stage that used them has one). Before the first
step every rank runs the stages one after another beside the whole network on a real micro-batch, and refuses a
split whose stages do not reproduce the network's output (a block's output read again past a later stage's blocks,
as a U-Net's skip connections do; what precedes the blocks each stage computes itself, so skips from there hold).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from unifit.errors import ConfigError
from unifit.strategies.torch_compat import tree_flatten, tree_unflatten


def block_bounds(network: torch.nn.Module, splits: list[str]) -> tuple[str, list[int]] | None:
    """(the list of blocks the split points index, where each stage's blocks start and the last ends), where every
    split point is an item of one ModuleList or Sequential; None otherwise."""
    parents = {point.rpartition(".")[0] for point in splits}
    if len(parents) != 1:
        return None
    parent = parents.pop()
    blocks = network.get_submodule(parent)
    indices = [point.rpartition(".")[2] for point in splits]
    if not isinstance(blocks, (torch.nn.ModuleList, torch.nn.Sequential)) or not all(i.isdigit() for i in indices):
        return None
    starts = [int(i) for i in indices]
    if starts != sorted(set(starts)) or starts[0] == 0:
        return None
    return parent, [0, *starts, len(blocks)]


class _Handed(Exception):
    """Ends a stage's forward at the first block after it, carrying that block's input."""

    def __init__(self, activation: torch.Tensor) -> None:
        super().__init__()
        self.activation = activation


def _activation(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | str, torch.Tensor]:
    """Where a block's input activation is in its call (its first argument) and what it is."""
    where: int | str = 0 if args else next(iter(kwargs), "")
    value = args[0] if args else kwargs.get(str(where))
    if not isinstance(value, torch.Tensor):
        raise ConfigError(
            f"trainer.strategy_options.pipeline_parallel: a block of the split list was called with "
            f"{type(value).__name__} as its first argument; stages built from blocks hand one tensor on (the hidden "
            "state, as a transformer's blocks take it)"
        )
    return where, value


def _replaced(args: tuple[Any, ...], kwargs: dict[str, Any], where: int | str, value: Any) -> tuple[Any, Any]:
    if isinstance(where, int):
        return (value, *args[1:]), kwargs
    return args, {**kwargs, where: value}


class BlockStage(torch.nn.Module):
    """One stage: the network's forward from the block `start` up to the block `end` (the last stage: to the end).
    Stage 0 takes the network's inputs (flattened, positional); a later one the activation received, then the
    network's inputs as keyword arguments `input0`, `input1`, ... (the schedule cuts them into micro-batches)."""

    def __init__(self, network: torch.nn.Module, blocks: torch.nn.Module, start: int, end: int, inputs: Any) -> None:
        super().__init__()
        self.net = network
        self._blocks = list(blocks)  # a plain list: the blocks are the network's, not registered twice
        self.start, self.end = start, end
        self.first, self.last = start == 0, end == len(self._blocks)
        self.inputs = inputs  # the pytree spec of the network's (args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.first:
            leaves, received = list(args), None
        else:
            (received,) = args
            leaves = [kwargs[f"input{i}"] for i in range(len(kwargs))]
        call_args, call_kwargs = tree_unflatten(leaves, self.inputs)
        try:
            with self._routed(received):
                output = self.net(*call_args, **call_kwargs)
        except _Handed as handed:
            return handed.activation
        return tuple(leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor))

    @contextlib.contextmanager
    def _routed(self, received: torch.Tensor | None) -> Iterator[None]:
        hooks = []
        skipped = self._blocks[: self.start]
        for block in skipped:  # computes nothing: its input goes on, replaced at the stage's first block
            block.forward = _pass_through  # type: ignore[method-assign]
        if received is not None:

            def take(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                where, _ = _activation(args, kwargs)
                return _replaced(args, kwargs, where, received)

            hooks.append(self._blocks[self.start].register_forward_pre_hook(take, with_kwargs=True))
        if not self.last:
            hooks.append(self._blocks[self.end].register_forward_pre_hook(_hand_on, with_kwargs=True))
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for block in skipped:
                block.__dict__.pop("forward", None)


def _pass_through(*args: Any, **kwargs: Any) -> torch.Tensor:
    return _activation(args, kwargs)[1]


def _hand_on(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    raise _Handed(_activation(args, kwargs)[1])


@contextlib.contextmanager
def evaluating(network: torch.nn.Module) -> Iterator[None]:
    """The network in evaluation mode without gradients (a forward that changes nothing: no running statistics
    updated, no dropout drawn), its modules' modes restored after."""
    training = {module: module.training for module in network.modules()}
    network.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, mode in training.items():
            module.train(mode)


def check_chained(stages: list[BlockStage], network: torch.nn.Module, leaves: list[Any], name: str) -> None:
    """The stages run one after another reproduce the whole network's output on `leaves` (eval mode, no gradients),
    or the split is refused in one line on every rank."""
    with evaluating(network):
        call_args, call_kwargs = tree_unflatten(leaves, stages[0].inputs)
        whole = [t for t in tree_flatten(network(*call_args, **call_kwargs))[0] if isinstance(t, torch.Tensor)]
        named = {f"input{i}": leaf for i, leaf in enumerate(leaves)}
        out = stages[0](*leaves)
        for stage in stages[1:]:
            out = stage(out, **named)
    chained = list(out)
    same = len(chained) == len(whole) and all(
        a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)
        for a, b in zip(chained, whole)
    )
    if not same:
        raise ConfigError(
            f"trainer.strategy_options.split_points: self.{name} split into stages at its blocks does not compute "
            "what it computes whole (something after a split point reads a block output from before it, as a skip "
            "connection across it does); choose split points only the hand-on crosses, or set stages: trace"
        )
