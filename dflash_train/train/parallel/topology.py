"""Who does what: an explicit, validated topology built from torchrun's environment.

One process per device, always; this module never starts threads or processes. Roles:
  colocated      every rank runs the target, then its drafter step (1 rank = one GPU or the CPU)
  disaggregated  ranks [0, T) run the target and send taps; ranks [T, world) train the drafter.
                 Target ranks form groups of `target_group_size` consecutive ranks; a group holds
                 one copy of the target, split over its ranks: sharded (`target_parallel=tensor`,
                 model/target/tensor_parallel.py; all members run every micro-batch, the first rank sends
                 the taps) or in pipeline stages (`pipeline`, model/target/pipeline_stages.py; each member
                 runs its consecutive layers and passes the hidden state on, the last one sends).
                 Work goes to groups as it would go to single target ranks (size 1: one rank each).
  offline        every rank trains from stored hidden-state shards; no target forward
Drafter ranks train data-parallel among themselves (their own process group).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dflash_train.model.target.tensor_parallel import group_mesh

MODES = ("colocated", "disaggregated", "offline")
TARGET_PARALLEL = ("tensor", "pipeline")


@dataclass(frozen=True)
class Topology:
    mode: str
    world_size: int
    rank: int
    local_rank: int
    num_target_ranks: int  # ranks that run the target and only that (disaggregated)
    target_group_size: int = 1  # target ranks that share one copy of the target
    target_parallel: str = "tensor"  # how a group splits it: tensor (shards) or pipeline (layer stages)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"topology.mode {self.mode!r}: expected one of {MODES}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        if self.mode == "disaggregated":
            if self.world_size < 2:
                raise ValueError("topology.mode=disaggregated needs at least 2 processes (1 target + 1 drafter); "
                                 "run under torchrun --nproc_per_node=N, or use mode=colocated")
            if not 1 <= self.num_target_ranks < self.world_size:
                raise ValueError(f"topology.target_ranks={self.num_target_ranks} must be in [1, {self.world_size - 1}]"
                                 f" for a world of {self.world_size} (at least one drafter rank)")
        if self.target_parallel not in TARGET_PARALLEL:
            raise ValueError(f"topology.target_parallel {self.target_parallel!r}: expected one of {TARGET_PARALLEL}")
        if self.target_group_size < 1 or self.num_target_ranks % self.target_group_size:
            raise ValueError(f"topology.target_group_size={self.target_group_size} must divide "
                             f"topology.target_ranks={self.num_target_ranks}")

    @property
    def target_ranks(self) -> list[int]:
        return list(range(self.num_target_ranks)) if self.mode == "disaggregated" else []

    @property
    def num_target_groups(self) -> int:
        return self.num_target_ranks // self.target_group_size if self.mode == "disaggregated" else 0

    @property
    def target_groups(self) -> list[list[int]]:
        """Consecutive target ranks, `target_group_size` per group, in group order."""
        g = self.target_group_size
        return [self.target_ranks[i * g:(i + 1) * g] for i in range(self.num_target_groups)]

    @property
    def target_group_index(self) -> int:
        """This target rank's group (which micro-batches it computes); -1 on drafter ranks."""
        return self.rank // self.target_group_size if self.is_target else -1

    @property
    def sender_ranks(self) -> list[int]:
        """The rank of each group that sends the group's taps to drafter ranks: the first (tensor
        parallel: every member ends with the whole taps) or the last stage (pipeline)."""
        return [group[-1] if self.pipeline else group[0] for group in self.target_groups]

    @property
    def pipeline(self) -> bool:
        """Target groups of several ranks split the target into pipeline stages."""
        return self.target_parallel == "pipeline" and self.target_group_size > 1

    @property
    def stage(self) -> int:
        """This target rank's place in its group (its pipeline stage); -1 on drafter ranks."""
        return self.rank % self.target_group_size if self.is_target else -1

    @property
    def is_sender(self) -> bool:
        return self.rank in self.sender_ranks

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(len(self.target_ranks), self.world_size))

    @property
    def is_target(self) -> bool:
        return self.rank in self.target_ranks

    @property
    def runs_target_forward(self) -> bool:
        return self.target_in_process or self.is_target

    @property
    def target_in_process(self) -> bool:
        """Every rank runs the target itself, right before its drafter step (colocated)."""
        return self.mode == "colocated"

    @property
    def has_target_ranks(self) -> bool:
        """Taps travel from target ranks to drafter ranks (disaggregated)."""
        return self.mode == "disaggregated"

    @property
    def reads_shards(self) -> bool:
        """Taps come from `dflash-train prepare` shards (offline)."""
        return self.mode == "offline"

    @property
    def num_drafters(self) -> int:
        return len(self.drafter_ranks)

    @property
    def drafter_index(self) -> int:
        """Position among the drafter ranks (its data-parallel rank); -1 on target ranks."""
        return self.drafter_ranks.index(self.rank) if self.rank in self.drafter_ranks else -1

    @property
    def is_main(self) -> bool:
        """The drafter rank that logs, evaluates and writes checkpoints."""
        return self.drafter_index == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def role(self, rank: int) -> str:
        """What `rank` does, as messages name it: target, main drafter or drafter."""
        if rank in self.target_ranks:
            return "target"
        return "main drafter" if rank == self.drafter_ranks[0] else "drafter"

    def describe(self) -> str:
        if self.mode == "disaggregated" and self.target_group_size > 1:
            how = " pipeline stages" if self.pipeline else ""
            return (f"disaggregated: {self.num_target_ranks} target ranks in {self.num_target_groups} groups of "
                    f"{self.target_group_size}{how} -> {self.num_drafters} drafter rank(s)")
        if self.mode == "disaggregated":
            return f"disaggregated: {self.num_target_ranks} target rank(s) -> {self.num_drafters} drafter rank(s)"
        return f"{self.mode}: {self.world_size} rank(s), each {'target + drafter' if self.mode == 'colocated' else 'drafter from shards'}"


def topology_from_env(mode: str, target_ranks: int, target_group_size: int = 1,
                      target_parallel: str = "tensor") -> Topology:
    """Read RANK / WORLD_SIZE / LOCAL_RANK (torchrun); a plain run is a world of one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    disaggregated = mode == "disaggregated"
    return Topology(mode=mode, world_size=world, rank=int(os.environ.get("RANK", "0")),
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                    num_target_ranks=target_ranks if disaggregated else 0,
                    target_group_size=target_group_size if disaggregated else 1, target_parallel=target_parallel)


def pick_device(topo: Topology) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(topo.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(topo: Topology, device: torch.device, timeout_s: float = 1800.0):
    """Start the process group (NCCL on GPU, gloo on CPU); return the drafter ranks' group.

    The drafter group carries gradient all-reduces and the per-step metric sums; on a world of
    one there is no process group and the function returns None.
    """
    if not topo.distributed:
        return None
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    if topo.mode != "disaggregated":
        return dist.group.WORLD
    return dist.new_group(topo.drafter_ranks)


def control_group(topo: Topology):
    """A gloo group of the whole world for the stop protocol (train/watch/stop.py) and for what the main
    drafter rank shares at start-up (samples, the resume point): CPU tensors, so it never waits on a
    device nor shares a communicator with taps or gradients. Collective: every rank calls it, right
    after `init_distributed`; None for a world of one."""
    return dist.new_group(backend="gloo") if topo.distributed else None


def init_target_groups(topo: Topology, device: torch.device) -> DeviceMesh | None:
    """The mesh of this rank's target group, when groups hold more than one rank (else None).
    Collective: every rank of the world calls it, right after `init_distributed`."""
    if topo.mode != "disaggregated" or topo.target_group_size == 1 or topo.pipeline:
        return None  # pipeline stages talk point to point (model/target/pipeline_stages.py)
    return group_mesh(topo.target_groups, device.type)
