"""The one place that maps `DrafterConfig.arch` to a drafter class and to its checkpoint names.

Everything else builds drafters through `build_drafter` and reads or writes configs through
`hf_format`, which asks this table: the training loop, the sources, checkpoints and evaluation never
ask which architecture they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_train.model.config import DrafterConfig
from dflash_train.model.dflash2 import DFlash2Drafter
from dflash_train.model.drafter import DFlashDrafter
from dflash_train.model.dspark import DSparkDrafter


@dataclass(frozen=True)
class Architecture:
    cls: type
    architectures: tuple[str, ...]
    """config.json `architectures`: the engines pick their drafter class by it."""
    dflash_keys: tuple[str, ...] = ()
    """DrafterConfig fields written to (and read from) `dflash_config`."""
    default_block: int | None = None
    """The block size this architecture is published with, where it differs from the recipe's."""


ARCHITECTURES = {
    "dflash": Architecture(DFlashDrafter, ("DFlashDraftModel",)),
    "dflash2": Architecture(DFlash2Drafter, ("DFlash2DraftModel",),
                            ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"), 8),
    "dspark": Architecture(DSparkDrafter, ("DSparkDraftModel",), ("markov_rank",)),
}


def build_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """The drafter module of cfg.arch (parameters uninitialised: call `reset_parameters`)."""
    return ARCHITECTURES[cfg.arch].cls(cfg)


def arch_of_architectures(names, source: str = "config.json") -> str:
    """The arch whose `architectures` list a checkpoint names; a ValueError naming the file otherwise."""
    for arch, spec in ARCHITECTURES.items():
        if list(names or []) == list(spec.architectures):
            return arch
    known = ", ".join(f"{list(a.architectures)}" for a in ARCHITECTURES.values())
    raise ValueError(f"{source}: architectures {names!r} is not a drafter this trainer reads ({known})")
