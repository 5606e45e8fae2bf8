"""smddp-like: what SageMaker's distributed data parallel library does, on any cluster.

DDP whose gradient allreduce is hierarchical over DDP's fused buckets: each bucket is reduced
inside a node onto its local leader (fast local links), the leaders all-reduce across nodes
(the network carries each gradient once per node instead of the flat ring's 2(N-1)/N share per
rank), and the leader broadcasts the result inside its node. Where `smdistributed.dataparallel`
is importable (on SageMaker) the real `smddp` backend is used instead, as its docs show.

Topology comes from the launcher (LOCAL_WORLD_SIZE, GROUP_RANK; torchrun numbers ranks node by
node) or, on SageMaker, from its variables; `strategy_options.local_world_size` overrides it.
With one node, or one rank per node, the hierarchy has nothing to gain and plain DDP runs.
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import threading
from typing import Any, Literal

import torch
from pydantic import Field, PositiveInt

from unifit.errors import ConfigError
from unifit.strategies.ddp import DDPOptions, DDPStrategy

log = logging.getLogger("unifit")


class SMDDPOptions(DDPOptions):
    """DDP's options plus the topology override and the choice of backend."""

    local_world_size: PositiveInt | None = Field(
        None, description="ranks per node (default: the launcher's, or SageMaker's); sets the two-level topology"
    )
    implementation: Literal["auto", "hierarchical", "smddp"] = Field(
        "auto",
        description="smddp: SageMaker's smdistributed.dataparallel backend; hierarchical: unifit's reduce within a "
        "node, all-reduce across node leaders, broadcast back; auto: smddp where installed, else hierarchical",
    )


def smddp_available() -> bool:
    return (
        importlib.util.find_spec("smdistributed") is not None
        and importlib.util.find_spec("smdistributed.dataparallel") is not None
    )


class Topology:
    """Node-major rank layout: node n holds ranks n*L ... n*L+L-1."""

    def __init__(self, world_size: int, local_size: int, rank: int) -> None:
        if local_size < 1 or world_size % local_size:
            raise ConfigError(
                f"smddp-like: world size {world_size} is not a multiple of the ranks per node ({local_size}); "
                "start the same number of processes on every node (or fix strategy_options.local_world_size)"
            )
        self.world_size, self.local_size, self.rank = world_size, local_size, rank
        self.nodes = world_size // local_size
        self.node = rank // local_size
        self.leader = self.node * local_size

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.local_size, (node + 1) * self.local_size))

    @property
    def leaders(self) -> list[int]:
        return [n * self.local_size for n in range(self.nodes)]


class HierarchicalAllReduce:
    """Intra-node reduce, leaders' allreduce, intra-node broadcast, for each DDP bucket.

    Every rank creates every subgroup in the same order, as torch.distributed requires. Buckets
    are handed to one worker thread that runs the three stages in bucket order, so collectives
    are issued in the same order on every rank while backward goes on computing (overlap, like
    DDP's own allreduce). The result equals a flat allreduce up to summation order.
    """

    def __init__(self, topology: Topology) -> None:
        import torch.distributed as dist

        self.topology = topology
        self.local_group = None
        for node in range(topology.nodes):
            group = dist.new_group(topology.node_ranks(node))
            if node == topology.node:
                self.local_group = group
        self.leader_group = dist.new_group(topology.leaders)
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="unifit-hierarchical-allreduce", daemon=True)
        self._worker.start()

    def reduce(self, bucket: Any) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        self._queue.put((bucket.buffer(), future))
        return future

    def _work(self) -> None:
        import torch.distributed as dist

        topo = self.topology
        while True:
            item = self._queue.get()
            if item is None:
                return
            tensor, future = item
            try:
                tensor.div_(topo.world_size)
                dist.reduce(tensor, dst=topo.leader, group=self.local_group)
                if topo.is_leader:
                    dist.all_reduce(tensor, group=self.leader_group)
                dist.broadcast(tensor, src=topo.leader, group=self.local_group)
                future.set_result(tensor)
            except Exception as exc:  # surfaces in backward() on this rank
                future.set_exception(exc)

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=10)


def hierarchical_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """The DDP communication hook; `state` is the process's HierarchicalAllReduce."""
    return state.reduce(bucket)


class SMDDPLikeStrategy(DDPStrategy):
    name = "smddp-like"
    Options = SMDDPOptions

    def setup(self) -> None:
        self.use_smddp = self.options.implementation == "smddp" or (
            self.options.implementation == "auto" and smddp_available()
        )
        if self.options.implementation == "smddp" and not smddp_available():
            raise ConfigError(
                "trainer.strategy_options.implementation: 'smddp' needs smdistributed.dataparallel "
                "(SageMaker's library, present in SageMaker's training containers); use 'auto'"
            )
        local = self.options.local_world_size or self.env.local_world_size
        self.topology = Topology(self.world_size, local, self.rank)
        if self.local_rank >= local and self.options.local_world_size is None:
            raise ConfigError(f"smddp-like: local rank {self.local_rank} >= ranks per node {local}; fix the launcher")
        if self.use_smddp:
            import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  registers the 'smddp' backend
        super().setup()
        self._hook = None
        if self._group_ready() and not self.use_smddp and self.topology.nodes > 1 and self.topology.local_size > 1:
            self._hook = HierarchicalAllReduce(self.topology)
        log.info(
            "smddp-like: %s, %d node(s) x %d rank(s)",
            "smddp backend"
            if self.use_smddp
            else ("hierarchical allreduce" if self._hook else "flat allreduce (nothing to gain from a hierarchy)"),
            self.topology.nodes,
            self.topology.local_size,
        )

    def _init_kwargs(self) -> dict[str, Any]:
        return {} if self.use_smddp else super()._init_kwargs()  # smddp reads the MPI environment itself

    def _backend_name(self, device: Any) -> str:
        return "smddp" if self.use_smddp else super()._backend_name(device)

    def teardown(self) -> None:
        if getattr(self, "_hook", None) is not None:
            self._hook.close()
            self._hook = None
        super().teardown()

    def _register_comm_hook(self, ddp: Any) -> None:
        if self._hook is not None:
            ddp.register_comm_hook(state=self._hook, hook=hierarchical_hook)
