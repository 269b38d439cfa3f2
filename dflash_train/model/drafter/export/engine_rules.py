"""Where vLLM and SGLang read each drafter key of config.json, and what they refuse: one row per rule,
each naming the engine file and function it mirrors.

Read from the engines' code, never copied (shared/docs/serving-engines.md: vLLM 0.34.0 and main at
00746147, SGLang 0.5.23), the files as stored at: vLLM v1/worker/gpu/spec_decode/dflash/speculator.py
00746147, models/qwen3_dspark.py 0302ff40, spec_decode/dspark/speculator.py 02957b5a,
models/qwen3_dflash2.py 030da624, models/qwen3_dflash.py 036a00d1; SGLang models/dspark.py and
speculative/dspark_components/dspark_config.py 01f47623, speculative/dflash_utils.py 00731f0b. `check_placement` walks these rows for the keys a drafter's
head exports (its file's `Export`: keys and constants, plus the mask token and the tapped layers every
head has), so no rule asks which head it checks: a new head's keys are checked as soon as it lists
them and the engines' rows for them exist here. Each failure names
the engines that would refuse to load the drafter (`Failure.refused_by`); the others would load it
and serve it wrong, which the message says.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_train.model.drafter.head import SGLANG, VLLM

ENGINES = {VLLM: "vLLM 0.34.0", SGLANG: "SGLang 0.5.23"}
MISSING = object()


@dataclass(frozen=True)
class Place:
    """A key of config.json: `dflash_config.<name>` or the top-level `<name>`; `plus` is added to each
    id the engine reads there (vLLM reads `eagle_aux_hidden_state_layer_ids` as tap ids + 1)."""

    path: str
    plus: int = 0

    def value(self, d: dict):
        section, _, name = self.path.rpartition(".")
        where = (d.get(section) or {}) if section else d
        got = where.get(name, MISSING) if isinstance(where, dict) else MISSING
        if got is MISSING or not self.plus or not isinstance(got, list):
            return got
        return [i - self.plus if isinstance(i, int) else i for i in got]


@dataclass(frozen=True)
class Read:
    """How `engine` reads the trainer's `key`: the first of `places` that is present; when none is,
    it refuses the drafter (`default` MISSING) or uses `default` without a word."""

    engine: str
    key: str
    places: tuple[Place, ...]
    mirrors: str
    default: object = MISSING


@dataclass(frozen=True)
class Refusal:
    """`engine` refuses the drafter when `place` holds a truthy value."""

    engine: str
    place: Place
    mirrors: str
    why: str


def _places(*paths: str) -> tuple[Place, ...]:
    return tuple(Place(p) for p in paths)


_VLLM_DFLASH2 = "vllm/model_executor/models/qwen3_dflash2.py DFlash2Qwen3DecoderLayer / DFlash2Qwen3Model.__init__"
_VLLM_DSPARK = "vllm/model_executor/models/qwen3_dspark.py Qwen3DSparkModel.__init__"
_SGL_PARSE = "python/sglang/srt/speculative/dflash_utils.py parse_dflash_draft_config"
_SGL_DSPARK = ("python/sglang/srt/speculative/dspark_components/dspark_config.py parse_dspark_draft_config, "
               "python/sglang/srt/models/dspark.py build_markov_head / build_confidence_head")

READS = (
    # --- every head
    Read(VLLM, "mask_token_id", _places("dflash_config.mask_token_id", "mask_token_id"),
         "vllm/v1/worker/gpu/spec_decode/utils.py get_parallel_drafting_token_id"),
    Read(VLLM, "target_layer_ids", (Place("eagle_aux_hidden_state_layer_ids", plus=1),
                                    *_places("dflash_config.target_layer_ids", "target_layer_ids")),
         "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config",
         default="the target model's default aux layers"),
    Read(SGLANG, "mask_token_id", _places("dflash_config.mask_token_id", "mask_token_id"), _SGL_PARSE,
         default="its default mask token's id"),
    Read(SGLANG, "target_layer_ids", _places("dflash_config.target_layer_ids", "target_layer_ids"), _SGL_PARSE,
         default="layer ids it derives from the layer counts (build_target_layer_ids)"),
    # --- a reduced draft vocabulary (model/drafter/export/draft_vocab.py): vLLM sizes the drafter's lm_head and
    # d2t by it, else by vocab_size (the whole vocabulary); SGLang reads no such key and drafts over the target's
    Read(VLLM, "draft_vocab_size", _places("draft_vocab_size"),
         "vllm/model_executor/models/qwen3_dflash.py DFlashQwen3ForCausalLM.__init__",
         default="vocab_size (the whole vocabulary)"),
    # --- DFlash 2: vLLM indexes dflash_config[...] (a KeyError without them); SGLang reads them there with
    # default 0, which builds plain DFlash layers and skips the convolution and selector weights
    *(Read(VLLM, key, _places(f"dflash_config.{key}"), _VLLM_DFLASH2)
      for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")),
    *(Read(SGLANG, key, _places(f"dflash_config.{key}"), _SGL_PARSE, default=0)
      for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")),
    # --- DSpark: vLLM's hf_config attributes (the top level only)
    Read(VLLM, "markov_rank", _places("markov_rank"), _VLLM_DSPARK),
    Read(VLLM, "enable_confidence_head", _places("enable_confidence_head"), _VLLM_DSPARK, default=False),
    Read(VLLM, "confidence_head_with_markov", _places("confidence_head_with_markov"), _VLLM_DSPARK, default=False),
    Read(VLLM, "sample_from_anchor", _places("sample_from_anchor"),
         "vllm/v1/worker/gpu/spec_decode/dspark/speculator.py DSparkSpeculator.__init__", default=True),
    # SGLang: the top level (or a dspark_config section, which we do not write); markov_head_type is required
    # with a Markov head; sample_from_anchor and the confidence head's input are top-level attributes
    Read(SGLANG, "markov_rank", _places("markov_rank"), _SGL_DSPARK),
    Read(SGLANG, "markov_head_type", _places("markov_head_type"), _SGL_DSPARK),
    Read(SGLANG, "confidence_head_with_markov", _places("confidence_head_with_markov"), _SGL_DSPARK, default=True),
    Read(SGLANG, "sample_from_anchor", _places("sample_from_anchor"), _SGL_DSPARK, default=True),
)

REFUSALS = (
    Refusal(VLLM, Place("dflash_config.sample_from_anchor"),
            "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py DFlashSpeculator.__init__ (which DSpark's "
            "speculator runs first)", "'sample_from_anchor=True is not supported for DFlash'"),
)


@dataclass(frozen=True)
class Finding:
    """One engine rule the drafter breaks: the config field, what happens, the engines refusing it."""

    field: str
    message: str
    refused_by: tuple[str, ...]


def expected_keys(export, cfg, draft_vocab_size: int | None = None) -> dict:
    """The values the drafter was trained with, for every key an engine reads: the mask token and
    tapped layers of every head, the rows of a reduced draft vocabulary's lm_head where it has one, then its
    head's own keys (from its settings) and constants (`export`: the head's `model/drafter/head.py` Export)."""
    return {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
            **({} if draft_vocab_size is None else {"draft_vocab_size": draft_vocab_size}),
            **{key: getattr(cfg, field) for key, field in export.keys}, **dict(export.constants)}


def check_placement(d: dict, expected: dict) -> list[Finding]:
    """Every rule of READS and REFUSALS that config dict `d` breaks for the `expected` values."""
    out = [Finding(r.place.path, f"{r.engine} refuses the drafter: {r.mirrors} raises {r.why}; "
                                 "this key belongs at the top level for the heads that have it", (r.engine,))
           for r in REFUSALS if r.place.value(d) not in (MISSING, None, False, 0)]
    for rule in READS:
        if rule.key in expected:
            finding = _read(rule, d, expected[rule.key])
            if finding is not None:
                out.append(finding)
    return _merged(out)


def _read(rule: Read, d: dict, want) -> Finding | None:
    for place in rule.places:
        got = place.value(d)
        if got is not MISSING:
            if got == want:
                return None
            return Finding(place.path, f"{rule.engine} reads {got!r} here ({rule.mirrors}); the drafter was trained "
                                       f"with {want!r}", ())
    where = " or ".join(p.path for p in rule.places)
    if rule.default is MISSING:
        message = (f"missing: {rule.engine} reads it from {where} only and refuses the drafter without it "
                   f"({rule.mirrors}); trained with {want!r}")
        return Finding(rule.places[0].path, message, (rule.engine,))
    if rule.default == want:
        return None
    return Finding(rule.places[0].path, f"missing: {rule.engine} reads it from {where} only and would use "
                                        f"{rule.default!r} ({rule.mirrors}); the drafter was trained with {want!r}", ())


def _merged(findings: list[Finding]) -> list[Finding]:
    """One finding per field: the engines' messages joined, every refusing engine named."""
    by_field: dict[str, Finding] = {}
    for f in findings:
        seen = by_field.get(f.field)
        by_field[f.field] = f if seen is None else Finding(
            f.field, f"{seen.message}; {f.message}", tuple(dict.fromkeys(seen.refused_by + f.refused_by)))
    return list(by_field.values())


def verdicts(failures) -> list[str]:
    """A line per engine: what it would refuse, or that it would load the drafter (and whether other
    failures mean it would serve it wrong)."""
    lines = []
    for engine, named in ENGINES.items():
        refused = list(dict.fromkeys(f.field for f in failures if engine in getattr(f, "refused_by", ())))
        if refused:
            lines.append(f"{named}: would refuse to load it ({', '.join(refused)})")
        elif failures:
            lines.append(f"{named}: would load it and serve it wrong (see the failures above)")
        else:
            lines.append(f"{named}: loads it as trained")
    return lines
