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
    """config.json `architectures` we write: the engines pick their drafter class by it."""
    dflash_keys: tuple[str, ...] = ()
    """DrafterConfig fields written to (and read from) `dflash_config`."""
    constants: tuple[tuple[str, object], ...] = ()
    """Fixed keys the engines read, which describe what this trainer's class is (written, and checked)."""
    top_level: bool = False
    """The keys above at the top level of config.json instead of in `dflash_config`: vLLM reads DSpark's
    keys there only (vllm/model_executor/models/qwen3_dspark.py, spec_decode/dspark/config.py), and its
    DFlash base class, which DSpark's speculator runs first, refuses a truthy
    `dflash_config.sample_from_anchor` (v1/worker/gpu/spec_decode/dflash/speculator.py); SGLang reads
    `markov_rank` and `markov_head_type` from either place and `sample_from_anchor` from the top level
    only; DeepSeek's DeepSpec exporter writes them all at the top level."""
    also_read: tuple[tuple[str, ...], ...] = ()
    """Other `architectures` lists that name the same drafter."""
    vllm_method: str = "dflash"
    sglang_algorithm: str = "DFLASH"

    def drafted(self, block_size: int) -> int:
        """Tokens one step drafts: vLLM's num_speculative_tokens (SGLang's draft tokens are one more)."""
        return block_size - self.cls.drafted_offset


ARCHITECTURES = {
    "dflash": Architecture(DFlashDrafter, ("DFlashDraftModel",)),
    "dflash2": Architecture(DFlash2Drafter, ("DFlash2DraftModel",),
                            ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")),
    # engine-formats.md A: the flat format DeepSeek's DeepSpec writes, which vLLM and SGLang both load
    "dspark": Architecture(DSparkDrafter, ("Qwen3DSparkModel",), ("markov_rank",),
                           (("markov_head_type", "vanilla"), ("enable_confidence_head", True),
                            ("confidence_head_with_markov", True), ("sample_from_anchor", True)),
                           top_level=True, also_read=(("DSparkDraftModel",),), vllm_method="dspark",
                           sglang_algorithm="DSPARK"),
}


def build_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """The drafter module of cfg.arch (parameters uninitialised: call `reset_parameters`)."""
    return ARCHITECTURES[cfg.arch].cls(cfg)


def arch_of_architectures(names, source: str = "config.json") -> str:
    """The arch whose `architectures` list a checkpoint names; a ValueError naming the file otherwise."""
    for arch, spec in ARCHITECTURES.items():
        if list(names or []) in [list(spec.architectures), *map(list, spec.also_read)]:
            return arch
    known = ", ".join(f"{list(a.architectures)}" for a in ARCHITECTURES.values())
    raise ValueError(f"{source}: architectures {names!r} is not a drafter this trainer reads ({known})")
