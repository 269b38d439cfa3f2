"""What a drafter head declares about itself: one `Head` value per head file, collected by the registry
(model/drafter/heads/architectures.py).

A head is the part of a drafter that turns the DFlash backbone's hidden states into drafts: plain
DFlash (model/drafter/backbone.py), DFlash 2 (model/drafter/heads/dflash2.py), DSpark (model/drafter/heads/dspark.py), Domino
(model/drafter/heads/domino.py). Its file holds
- its module: a `DFlashDrafter` subclass, the interface the step, the loss and the eval call
  (which slots draft, the logit bias, its own loss term, the greedy choice, the drafting walk);
- its settings: a frozen keyword-only dataclass whose fields (defaults, one-line docstrings) join
  the config tree's `drafter.*` section and `DrafterConfig`, so both have one source of defaults;
- a `Head` naming the rest: the block it is published with, how vLLM and SGLang read and serve it
  (`Export`, `Engine`), which of its parameters stay out of Muon, its parameter count for `plan`,
  its settings' checks, a small size for smoke runs, and how other trainers write it (`Foreign`: what
  model/drafter/export/ecosystem.py reads a speculators or DeepSpec checkpoint of it by).
Nothing outside the head files and the registry asks which head trains.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

VLLM, SGLANG = "vLLM", "SGLang"


@dataclass(frozen=True)
class Engine:
    """How one engine serves a head: its speculative `method` (vLLM's `method`, SGLang's
    `--speculative-algorithm`) and what its token-count flag takes beyond the drafted tokens D
    (vLLM's num_speculative_tokens = D, SGLang's --speculative-num-draft-tokens = D + 1); or
    `refused`: why it does not serve the head (read in its loader code)."""

    name: str
    method: str = ""
    extra_tokens: int = 0
    flags: str = ""
    """More command-line flags the engine needs to serve the head as trained."""
    refused: str = ""


@dataclass(frozen=True)
class ReducedVocab:
    """How the engines treat a reduced draft vocabulary of this head: config.json `draft_vocab_size` n (its
    `vocab_size` stays the target's), the drafter's own `lm_head.weight` [n, H] and `d2t` [n] int64 with
    target id = draft id + d2t[draft id] (EAGLE-3's layout, which vLLM reads for the DFlash family:
    vllm/model_executor/models/qwen3_dflash.py DFlashQwen3ForCausalLM.load_weights / compute_logits).
    model/drafter/export/draft_vocab.py writes and reads it from this declaration alone."""

    served_by: tuple[str, ...] = ()
    """Engines that draft over the reduced vocabulary as it was trained."""
    ignored_by: tuple[str, ...] = ()
    """Engines that load such a drafter but skip `lm_head` and `d2t`: they draft over the target's whole lm_head."""
    not_exported: str = ""
    """Why our export keeps the whole vocabulary (the draft vocabulary beside, in draft_vocab.json, for our eval
    only), naming the engine code: another engine would refuse the reduced form or serve it wrong."""
    draft_rows: tuple[str, ...] = ()
    """This head's tensors that a reduced checkpoint stores with one row per draft token instead of one per
    token (read back into ours at the draft ids; the other rows are never read: their logits are -inf)."""

    @property
    def exported(self) -> bool:
        """An export of a drafter with a draft vocabulary writes it in the engines' reduced form."""
        return bool(self.served_by) and not self.not_exported


@dataclass(frozen=True)
class Export:
    """How a head's drafter appears in config.json, as the engines read it."""

    architectures: tuple[str, ...]
    """config.json `architectures` written: the engines pick their drafter class by it."""
    keys: tuple[tuple[str, str], ...] = ()
    """(config.json key, settings field): written from the settings and read back into them."""
    constants: tuple[tuple[str, object], ...] = ()
    """Fixed keys the engines read, which say what this trainer's module is (written, and checked)."""
    marks: tuple[tuple[str, object], ...] = ()
    """Constants that tell this head apart from another one written under the same `architectures`."""
    top_level: bool = False
    """The keys and constants at the top level of config.json instead of inside `dflash_config`."""
    also_read: tuple[tuple[str, ...], ...] = ()
    """Other `architectures` lists that name the same drafter (other trainers' exports)."""
    speculators_type: str | None = None
    """`speculators_model_type` of the speculators-format export; None: that format has no place for it."""
    reduced_vocab: ReducedVocab = ReducedVocab(not_exported="no engine is known to serve a reduced draft "
                                                             "vocabulary of this head")
    """How the engines treat a reduced draft vocabulary of it (`ReducedVocab`)."""

    def written(self) -> tuple[str, ...]:
        """Every key this head writes: its settings' keys and its constants."""
        return tuple(k for k, _ in self.keys) + tuple(k for k, _ in self.constants)


@dataclass(frozen=True)
class Foreign:
    """How other trainers write this head, for reading their checkpoints (model/drafter/export/ecosystem.py):
    the defaults of their config classes, which a config written as a diff against them leaves out."""

    speculators_type: str | None = None
    """`speculators_model_type` of speculators 0.9.0's drafter that is this head; None: speculators has none."""
    from_anchor: bool = False
    """It drafts from the anchor's slot (speculators' `sample_from_anchor` default for it; ours always does
    or never does)."""
    window_non_causal: bool = False
    """speculators' `sliding_window_non_causal` default for it."""
    deepspec: bool = False
    """DeepSeek's DeepSpec writes it (under its export `architectures`, without a `dflash_config`)."""
    deepspec_defaults: tuple[tuple[str, object], ...] = ()
    """DeepSpec's defaults of this head's keys, where they differ from speculators'."""
    heads: Callable[[dict], tuple[dict, tuple[str, ...]]] | None = None
    """A foreign config dict -> (this head's keys as our export writes them, the parts the checkpoint lacks);
    None: its export keys are copied as they are and nothing can be missing."""
    fill: Callable[[dict, object, tuple[str, ...]], dict] | None = None
    """(tensors, DrafterConfig, missing parts) -> the tensors with what drafting reads there (zeros)."""
    notes: tuple[tuple[str, str], ...] = ()
    """(missing part, what is said when a checkpoint lacks it)."""


def must_be_positive(values, names) -> list[str]:
    """`name=value: must be > 0` for each of the settings `names` of `values` that is not."""
    return [f"{name}={getattr(values, name)}: must be > 0" for name in names if getattr(values, name) <= 0]


def _no_problems(values, hidden_size: int | None) -> list[str]:
    return []


def _no_parameters(cfg) -> int:
    return 0


@dataclass(frozen=True)
class Head:
    name: str
    """The `drafter.arch` value."""
    module: type
    """Its drafter class (a `DFlashDrafter`), built from a `DrafterConfig`."""
    published_block: int
    """The block size it is published with: `drafter.block_size` when that is None."""
    export: Export
    engines: tuple[Engine, ...]
    settings: type | None = None
    """Frozen kw_only dataclass of its own `drafter.*` / DrafterConfig fields; None: it has none."""
    refusals: Callable[[object], dict[str, str]] | None = None
    """Engines that refuse a drafter of this head for some settings: cfg -> {engine: why}."""
    problems: Callable[[object, int | None], list[str]] = _no_problems
    """(an object holding its settings, the drafter's width or None) -> what cannot work, by field."""
    parameters: Callable[[object], int] = _no_parameters
    """DrafterConfig -> its parameters beyond the DFlash backbone (layers, fc, norms): `plan` counts them."""
    outside_muon: tuple[str, ...] = ()
    """Words in the names of its parameters that AdamW keeps (tables over the vocabulary, recurrences)."""
    small: tuple[tuple[str, object], ...] = ()
    """Settings that make it small for smoke runs, tests and `--small` benches."""
    foreign: Foreign | None = None
    """How other trainers' checkpoints of it read; None: no other trainer writes it."""

    def setting_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.settings)) if self.settings else ()

    def setting_defaults(self) -> dict:
        return {f.name: f.default for f in dataclasses.fields(self.settings)} if self.settings else {}

    def served(self, cfg) -> tuple[Engine, ...]:
        """Its engines for this drafter config: the static ones, with the config's refusals applied."""
        refused = self.refusals(cfg) if self.refusals else {}
        return tuple(dataclasses.replace(e, method="", refused=refused[e.name]) if e.name in refused else e
                     for e in self.engines)

