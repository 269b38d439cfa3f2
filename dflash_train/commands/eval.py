"""`dflash-train eval --drafter DIR [--target T] [...]`: real speculative decoding of held-out prompts
with a drafter directory against its target: ours or any published one in the z-lab, speculators or
DeepSeek DeepSpec format (told apart by config.json and read into our classes: model/drafter/export/ecosystem.py). A target without a chat
template (a base model; `data.format=auto` says so in one line) is measured on text sets.

Prints a summary table and ends with `dflash-train eval: OK tau=... speedup=...x`. Writes
report.json and two PNG plots to eval.out_dir (--out).
"""

from __future__ import annotations

from pathlib import Path

from dflash_train.commands import Alias, device_of, load_configured_target
from dflash_train.validate import validate_eval as validate  # noqa: F401 - the command's check

HELP = "real speculative decoding: tau, per-position acceptance, speedup"
RECIPE = None
READS = ("eval", "target", "data.thinking", "data.format", "data.text_prompt_tokens", "data.train", "data.max_samples",
         "data.eval_fraction", "train.seed", "topology.device", "loss.gamma", "loss.chunk_tokens")
ALIASES = (
    Alias("--drafter", "eval.drafter"), Alias("--target", "target.model"), Alias("--gguf-file", "target.gguf_file"),
    Alias("--prompts", "eval.prompts"), Alias("--num-prompts", "eval.num_prompts"),
    Alias("--max-new-tokens", "eval.max_new_tokens"), Alias("--temperature", "eval.temperature"),
    Alias("--thinking", "data.thinking"), Alias("--block-size", "eval.block_size"),
    Alias("--device", "topology.device"), Alias("--dtype", "target.dtype"), Alias("--seed", "train.seed"),
    Alias("--out", "eval.out_dir"), Alias("--trust-remote-code", "target.trust_remote_code", const="true"),
    Alias("--no-progress", "eval.progress", const="false"), Alias("--draft-vocab", "eval.draft_vocab"),
)


def run(cfg) -> str:
    from dflash_train.eval.prompt_sets import SetContext, load_prompt_sets
    from dflash_train.eval.evaluate import check_compatible, eval_draft_vocab, evaluate_as_served
    from dflash_train.model.drafter.export.ecosystem import load_drafter
    from dflash_train.model.drafter.export.hf_format import refuse_non_finite
    from dflash_train.train.setup import resolve_format

    e = cfg.eval
    resolved = []  # the config with data.format resolved (text sets for a target without a chat template)
    target = load_configured_target(cfg, check_tokenizer=lambda tok: resolved.append(resolve_format(cfg, tok, print)))
    cfg = resolved[0]
    loaded = load_drafter(e.drafter, num_target_layers=target.num_layers, device=device_of(cfg), dtype=target.dtype)
    drafter = loaded.drafter
    refuse_non_finite(drafter.state_dict(), e.drafter, "not evaluated (its tau would be meaningless)")
    print(f"eval: drafter {e.drafter} ({loaded.format} format, {drafter.config.arch}): "
          f"{drafter.config.num_layers} layers, block size "
          f"{e.block_size or drafter.config.block_size}, taps {list(drafter.config.target_layer_ids)}, "
          f"mask token {drafter.config.mask_token_id}", flush=True)
    for note in loaded.notes:
        print(f"eval: note: {note}", flush=True)
    check_compatible(drafter, target)  # before reading prompts: fail fast on the wrong pair
    context = SetContext(target=target, data=cfg.data, seed=cfg.train.seed, cache_dir=Path(e.out_dir) / "data")
    sets = load_prompt_sets(e.prompts, e.num_prompts, context)
    print("eval: " + ", ".join(f"{n}: {len(p)} prompts" for n, p in sets.items())
          + f"; max {e.max_new_tokens} new tokens, temperature {e.temperature}", flush=True)
    vocab = eval_draft_vocab(e, e.drafter, drafter)
    simulate = _simulator(cfg, drafter, target)
    report = evaluate_as_served(drafter, target, sets, e.draft_vocab, vocab, max_new_tokens=e.max_new_tokens,
                                temperature=e.temperature, thinking=cfg.data.thinking, block_size=e.block_size,
                                seed=cfg.train.seed, out_dir=e.out_dir, progress=e.progress,
                                simulate=simulate and (lambda v: simulate(v)),
                                text_prompt_tokens=cfg.data.text_prompt_tokens, near_tie_gap=cfg.eval.near_tie_gap,
                                near_tie_gap_float32=cfg.eval.near_tie_gap_float32, decoder=cfg.eval.decoder,
                                dtype=cfg.eval.dtype)
    _print_report(report, e.temperature)
    overall = report["overall"]
    return (f"tau={overall['tau']:.3f} speedup={overall['speedup']:.2f}x ({overall['num_prompts']} prompts, "
            f"{overall['spec_tokens']} tokens)")


def _simulator(cfg, drafter, target):
    """The train/serve check beside each set's real tau: the simulated tau (the decode walk, and per
    anchor; the drafter's own block size) on the very text the set decoded. None when `eval.block_size`
    decodes with another block size than the drafter was trained for (the two would not compare)."""
    import torch

    from dflash_train.config import derived_gamma
    from dflash_train.train.watch.simulate import simulator
    from dflash_train.train.step import StepContext

    dcfg = drafter.config
    if cfg.eval.block_size not in (None, dcfg.block_size):
        print(f"eval: no simulated tau (eval.block_size={cfg.eval.block_size}, the drafter's is {dcfg.block_size})",
              flush=True)
        return None
    ctx = StepContext(embed_weight=target.embed_weight.detach(), lm_head_weight=target.lm_head_weight.detach(),
                      drafter=dcfg, gamma=derived_gamma(dcfg.block_size, cfg.loss.gamma),
                      chunk_tokens=cfg.loss.chunk_tokens, backend="sdpa", device=target.device,
                      autocast_dtype=torch.bfloat16 if target.device.type == "cuda" else None)
    return lambda draft_vocab: simulator(drafter, target, ctx, draft_vocab)


def _print_report(report: dict, temperature: float) -> None:
    from dflash_train.eval.evaluate import set_notes
    from dflash_train.eval.report import summary_table

    print(summary_table({**report["sets"], "overall": report["overall"]}), flush=True)
    print(f"eval: decoded by the {report['decoder']} loops in {report['dtype']}; a draft+verify cycle costs "
          f"{report['overall']['cycle_plain_steps']:.2f} plain steps", flush=True)
    for name, figures in report["sets"].items():
        for note in set_notes(figures, report["dtype"], temperature):
            print(f"eval [{name}]: {note}", flush=True)
    print(f"eval: report {report['report']}; plots {', '.join(report['plots'])}", flush=True)
