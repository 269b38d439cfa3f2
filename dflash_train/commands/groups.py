"""Target groups for the data commands (`prepare`, `regenerate`) under torchrun: consecutive ranks
of `topology.target_group_size` share one target sharded over them (model/target/tensor_parallel.py), each
group works on its own contiguous share of the data, and only a group's first rank writes."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dflash_train.commands import device_of


@dataclass(frozen=True)
class Groups:
    """This process's place among torchrun's processes: its target group, whether it writes
    (the group's first rank), its device and the group's mesh (None for groups of one)."""

    rank: int
    world: int
    size: int
    device: str
    mesh: object = None

    @property
    def group(self) -> int:
        return self.rank // self.size

    @property
    def count(self) -> int:
        return self.world // self.size

    @property
    def writes(self) -> bool:
        return self.rank % self.size == 0


def join_groups(cfg) -> Groups:
    """A plain run is one group of one on `device_of(cfg)`; under torchrun, start the process group
    (gloo on the CPU, NCCL on GPUs, one per process) and build the groups' meshes."""
    world, size = int(os.environ.get("WORLD_SIZE", "1")), cfg.topology.target_group_size
    if world == 1:
        return Groups(0, 1, 1, device_of(cfg))
    import torch  # see commands/__init__.py: only `run` imports torch
    import torch.distributed as dist

    from dflash_train.model.target.tensor_parallel import group_mesh

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    rank = dist.get_rank()
    groups = [list(range(g, g + size)) for g in range(0, world, size)]
    mesh = group_mesh(groups, "cuda" if device.startswith("cuda") else "cpu") if size > 1 else None
    return Groups(rank, world, size, device, mesh)

