"""What to tell whoever serves an exported drafter: the serve command per engine (or why an engine does
not serve its head), how requests must be rendered, and how each engine treats the target's scaling.
Split from model/drafter/export/check.py, which verifies; this file only describes."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.model.drafter.head import SGLANG, VLLM, Engine
from dflash_train.model.drafter.export.hf_format import TRAINED_AGAINST, TRAINING_INPUT, read_head
from dflash_train.model.target.scaling import Scaling
from dflash_train.model.drafter.export.check import drafter_scaling, same_value
from dflash_train.model.target.identity import serve_note


ENGINE_SCALING_SUPPORT = {
    # field -> how the engines (sources read 2026-12) treat it for a DFlashDraftModel; z-lab's reference
    # `dflash` package applies all three from dflash_config
    "input_embedding_scale": "vLLM's DFlash drafter (qwen3_dflash.py) does not read it and embeds the block with "
                             "the target's unscaled embedding rows (vLLM PR #41703, open, scales Gemma 4 targets); "
                             "SGLang's (dflash_worker.py) does not read it and embeds with the target's own "
                             "embedding module, which scales where the target's does (Gemma 3 in SGLang)",
    "output_multiplier": "vLLM's DFlash drafter does not read it (only a top-level logit_scale); SGLang reads it; "
                         "greedy drafting does not depend on it, sampling (temperature > 0) does",
    "final_logit_softcapping": "vLLM's DFlash drafter does not read it; SGLang reads it; greedy drafting does not "
                               "depend on it, sampling (temperature > 0) does",
}


def engine_notes(drafter_dir: str | Path) -> list[str]:
    """An engine that does not serve the drafter's head (and why), and for each scaling field the drafter
    sets (not the identity) how the engines treat it: what to check before serving it there."""
    d = json.loads((Path(drafter_dir) / "config.json").read_text())
    h, settings = read_head(d, str(Path(drafter_dir) / "config.json"))
    refused = [f"{e.name} does not serve this {h.name} drafter: {e.refused}" for e in h.served(settings) if e.refused]
    values = drafter_scaling(d, d.get("dflash_config") or {})
    set_fields = {k: v for k, v in values.items() if not same_value(v, Scaling().as_dict()[k])}
    return refused + _draft_vocab_notes(d, h) + [
        f"dflash_config.{name}={value}: z-lab's dflash applies it; {ENGINE_SCALING_SUPPORT[name]}"
        for name, value in set_fields.items()]


def _draft_vocab_notes(d: dict, h) -> list[str]:
    """How each engine drafts a reduced draft vocabulary (its head's `Export.reduced_vocab`), where there is one."""
    size, reduced = d.get("draft_vocab_size"), h.export.reduced_vocab
    if size in (None, d.get("vocab_size")):
        return []
    served = f"drafted over these {size} tokens by {' and '.join(reduced.served_by) or 'no engine'} " \
             "(lm_head.weight, d2t)"
    ignored = f", over the target's whole lm_head by {' and '.join(reduced.ignored_by)} (it skips them)"
    return [f"draft_vocab_size={size}: {served}{ignored if reduced.ignored_by else ''}"]


def _requests_note(record) -> str:
    """How requests must be rendered to meet the drafter's training (published pitfall 5), one line."""
    if not isinstance(record, dict):
        return ""
    if record.get("format") == "text":
        return "  requests: plain text completions (trained on text continuation, no chat template)\n"
    thinking = record.get("thinking")
    mode = ("the template's default thinking mode" if thinking is None or not record.get("thinking_read_by_template")
            else f'chat_template_kwargs {{"enable_thinking": {str(thinking).lower()}}}')
    return (f"  requests: the target's chat template (sha256 {record.get('chat_template_sha256')}, as trained) with "
            f"{mode}, as in training\n")


def serve_instructions(drafter_dir: str | Path) -> str:
    """Serve commands for an exported drafter, naming the target it was trained against, each engine's
    method for its head (or why that engine does not serve it) and the drafted tokens per step (vLLM
    never reads block_size)."""
    d = json.loads((Path(drafter_dir) / "config.json").read_text())
    dflash = d.get("dflash_config") or {}
    h, settings = read_head(d, str(Path(drafter_dir) / "config.json"))
    drafted = h.module.drafted(dflash.get("block_size", d.get("block_size")))
    rec = dflash.get(TRAINED_AGAINST)
    target = rec["serve"] if isinstance(rec, dict) and rec.get("serve") else "TARGET"
    lines = [_serve_line(e, target, drafter_dir, drafted) for e in h.served(settings)]
    return (f"serve it with (target: {serve_note(rec)}):\n{_requests_note(dflash.get(TRAINING_INPUT))}"
            + "\n".join(lines))


def _serve_line(engine: Engine, target: str, drafter_dir, drafted: int) -> str:
    if engine.refused:
        return f"  {engine.name + ':':<7} not served: {engine.refused}"
    tokens = drafted + engine.extra_tokens
    flags = f" {engine.flags}" if engine.flags else ""
    if engine.name == VLLM:
        spec = json.dumps({"method": engine.method, "model": str(drafter_dir), "num_speculative_tokens": tokens})
        return f"  vLLM:   vllm serve {target} --speculative-config '{spec}' --attention-backend flash_attn{flags}"
    if engine.name == SGLANG:
        return (f"  SGLang: python -m sglang.launch_server --model-path {target} --speculative-algorithm "
                f"{engine.method} --speculative-draft-model-path {drafter_dir} --speculative-num-draft-tokens "
                f"{tokens}{flags}")
    raise ValueError(f"engine {engine.name!r}: no serve command known")
