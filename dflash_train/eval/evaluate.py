"""`evaluate`: real speculative decoding of prompt sets with a drafter against its target, versus
plain target decoding of the same prompts; the library entry that the CLI and the training job use.

Conventions:
- Chat prompts are message lists (an optional system message, then user/assistant turns); trailing
  assistant turns are dropped, so every prompt ends with a user turn, and it is rendered with the
  target's chat template and `add_generation_prompt=True` (`thinking` sets `enable_thinking`
  where the template reads it). Text prompts (base models) are documents: tokenized as the target
  reads text (its special tokens, e.g. a BOS) and cut where text training cuts them, after
  `text_prompt_tokens` tokens, at most half the document (`data/text.py split_point`).
- Generation stops at the target's end tokens (`eos_token_ids`) or after `max_new_tokens`.
- Each prompt gets its own generator seeded `seed + index`, shared by the speculative and the plain
  run, so a run is reproducible; the first prompt is decoded in full once untimed (warm-up): on a
  GPU a shorter warm-up left the first timed prompt at a third of the steady rate.
- Both decoders are timed alike: wall time (perf_counter, device synchronised) of the prefill and
  every step, per prompt, the speculative and the plain run back to back (load on a shared machine
  hits both); speedup = the ratio of their tokens/s (`report.py`).
- tau = tokens per target verification forward (accepted + 1), pooled over all steps of a set;
  see `report.py` for every figure in the report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash_train.config import DataConfig, EvalConfig
from dflash_train.data.conversations import prompt_messages, render_chat
from dflash_train.data.text import split_point
from dflash_train.eval import calibration, lossless, precision
from dflash_train.eval import report as rep
from dflash_train.eval.spec_decode import DraftHead, GenResult, SpecResult, speculative_generate, target_generate
from dflash_train.eval.static_decode import StaticDecoder, static_reason
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.drafter.export.draft_vocab import DRAFT_VOCAB, DraftVocab, read_draft_vocab
from dflash_train.model.drafter.heads.architectures import head

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def check_compatible(drafter: DFlashDrafter, target) -> None:
    """Raise ValueError naming the mismatch when the drafter was not built for this target."""
    try:
        drafter.config.check_target(target.hidden_size, target.num_layers, target.vocab_size)
    except ValueError as e:
        raise ValueError(f"drafter is not compatible with target {getattr(target, 'name', '?')}: {e}") from None


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_token_ids(tokenizer, model) -> set[int]:
    """End tokens: the generation config's and the tokenizer's eos, plus the usual end-of-turn tokens
    that exist in the vocabulary (chat models end a reply with these, not always with eos)."""
    ids = set(_as_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None)))
    ids |= set(_as_ids(getattr(model.config, "eos_token_id", None)))
    ids |= set(_as_ids(getattr(tokenizer, "eos_token_id", None)))
    vocab = tokenizer.get_vocab()
    ids |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    return ids


def encode_prompts(tokenizer, prompts: list, thinking: bool | None, device: torch.device,
                   text_prompt_tokens: int = DataConfig.text_prompt_tokens) -> list[torch.Tensor]:
    """Token ids [1, P] of each prompt, ready for generation: a message list through the chat template,
    a document (str) cut to its text prompt (see the module doc)."""
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            ids = torch.tensor([ids[:split_point(len(ids), text_prompt_tokens)]])
        else:
            text = render_chat(tokenizer, prompt_messages(prompt), add_generation_prompt=True, thinking=thinking)
            # the template already writes bos and role markers: add no special tokens twice
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        encoded.append(ids.to(device))
    return encoded


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class Decode:
    """One decode of the prompt sets: over a draft vocabulary or the whole lm_head, and the engines that serve the
    drafter directory that way (none: `why_none`)."""

    vocab: DraftVocab | None
    """None: the whole lm_head."""
    served_by: tuple[str, ...]
    why_none: str = ""

    def describe(self) -> str:
        what = "the whole lm_head" if self.vocab is None else f"the {self.vocab.size:,}-token draft vocabulary"
        if not self.served_by:
            return f"{what}, as no engine serves this directory ({self.why_none})"
        return f"{what}, as {' and '.join(self.served_by)} serve{'s' if len(self.served_by) == 1 else ''} it"

    def record(self) -> dict:
        """What report.json says of it."""
        return {"draft_vocab": None if self.vocab is None else self.vocab.size, "served_by": list(self.served_by),
                "drafts_over": self.describe()}


def decode_plan(cfg, setting: str, vocab: DraftVocab | None) -> tuple[Decode, Decode | None]:
    """(the headline decode, the one beside it or None) for `eval.draft_vocab` = `setting`. auto: what vLLM serves
    as the headline, the directory's draft vocabulary where it is in the engines' reduced form (its head's
    `Export.reduced_vocab`), with the whole lm_head, what the engines that skip d2t (SGLang) serve, beside; the whole
    lm_head first where the directory's draft vocabulary is one no engine reads (draft_vocab.json). full / subset:
    that one decode alone."""
    reduced_vocab = head(cfg.arch).export.reduced_vocab
    engines = tuple(e.name for e in head(cfg.arch).served(cfg) if not e.refused)
    if vocab is not None and vocab.served:
        reduced = Decode(vocab, tuple(e for e in engines if e in reduced_vocab.served_by))
        whole = Decode(None, tuple(e for e in engines if e in reduced_vocab.ignored_by), reduced_vocab.not_exported)
    else:
        whole = Decode(None, engines, "no engine serves this head with these settings")
        reduced = None if vocab is None else Decode(vocab, (), _unread_why(reduced_vocab))
    if setting == "full" or reduced is None:
        return whole, None
    if setting == "subset":
        return reduced, None
    return (reduced, whole) if vocab.served else (whole, reduced)


def _unread_why(reduced_vocab) -> str:
    if reduced_vocab.exported:
        return (f"{DRAFT_VOCAB} is read by no engine; `dflash-train export --target T` writes it in the form "
                f"{' and '.join(reduced_vocab.served_by)} serves: draft_vocab_size, lm_head, d2t")
    return reduced_vocab.not_exported


def eval_draft_vocab(eval_cfg, drafter_dir, drafter: DFlashDrafter, log=print) -> DraftVocab | None:
    """The drafter directory's draft vocabulary (either form: model/drafter/export/draft_vocab.py), with what
    `eval.draft_vocab` makes of it said in one line; None where it has none. With `full` it only names the engine
    the headline stands for: a malformed one is not read (full is the way round it)."""
    try:
        vocab = read_draft_vocab(drafter_dir, drafter.config.vocab_size)
    except ValueError:
        if eval_cfg.draft_vocab != "full":
            raise
        vocab = None
    if vocab is not None:
        headline, beside = decode_plan(drafter.config, eval_cfg.draft_vocab, vocab)
        log(f"eval: the drafter's draft vocabulary ({vocab.source}); the headline drafts over {headline.describe()}"
            + (f"; beside it, over {beside.describe()}" if beside else ""))
    return vocab


BESIDE_FIGURES = ("tau", "speedup", "cycle_plain_steps", "identical_outputs", "num_prompts")


def evaluate_as_served(drafter: DFlashDrafter, target, prompt_sets: dict, vocab_setting: str,
                       draft_vocab: DraftVocab | None, **kwargs) -> dict:
    """`evaluate` with the headline an engine serves (`decode_plan`: with `eval.draft_vocab=auto` vLLM's, the
    directory's reduced draft vocabulary where it has one) and, where the plan has one, the same prompts decoded
    the other way with its figures beside each set's (`beside`). report.json says per decode which engines serve
    it (`headline`, `beside`, each set's `drafts_over`). `simulate`, if given, maps the headline's draft vocabulary
    ids (None: the whole lm_head) to `evaluate`'s simulate."""
    headline, beside = decode_plan(drafter.config, vocab_setting, draft_vocab)
    simulate = kwargs.pop("simulate", None)
    report = evaluate(drafter, target, prompt_sets, **_vocab_args(headline),
                      simulate=simulate(_vocab_args(headline)["draft_vocab"]) if simulate else None, **kwargs)
    report["headline"] = headline.record()
    for figures in (*report["sets"].values(), report["overall"]):
        figures["drafts_over"] = headline.describe()
    if beside is not None:
        # warmed up too: each call decodes fresh cast copies (eval/precision.py), cold on their first prompt
        other = evaluate(drafter, target, prompt_sets, **_vocab_args(beside),
                         **{k: v for k, v in kwargs.items() if k != "out_dir"})
        report["beside"] = beside.record()
        for name in report["sets"]:
            report["sets"][name]["beside"] = {**beside.record(), **{k: other["sets"][name][k] for k in BESIDE_FIGURES}}
        report["overall"]["beside"] = {**beside.record(), **{k: other["overall"][k] for k in BESIDE_FIGURES}}
    if kwargs.get("out_dir") is not None:
        report["report"] = str(rep.write_json(report, Path(kwargs["out_dir"])))
    return report


def _vocab_args(decode: Decode) -> dict:
    """`evaluate`'s draft vocabulary arguments for a decode: its ids and the directory's own lm_head rows."""
    vocab = decode.vocab
    return {"draft_vocab": None if vocab is None else vocab.ids, "draft_rows": None if vocab is None else vocab.rows}


def beside_note(figures: dict) -> str | None:
    """`the figures above draft over ...; over ... instead: tau .., speedup ..` for a set measured both ways."""
    beside = figures.get("beside")
    if not beside:
        return None
    return (f"the figures above draft over {figures['drafts_over']}; over {beside['drafts_over']} instead: "
            f"tau {beside['tau']:.3f}, speedup {beside['speedup']:.2f}x (a cycle {beside['cycle_plain_steps']:.2f} "
            f"plain steps), {beside['identical_outputs']}/{beside['num_prompts']} identical")



def set_notes(figures: dict, dtype: str, temperature: float) -> list[str]:
    """The lines printed under a set's figures: the decode beside the headline, explained near-ties, prompts timed
    during a stall, the confidence head's calibration."""
    notes = (beside_note(figures), rep.lossless_note(figures, dtype == "float32", temperature),
             rep.timing_note(figures), figures.get("confidence") and calibration.describe(figures["confidence"]))
    return [note for note in notes if note]


def _decode_both(drafter, target, ids: torch.Tensor, opts: dict, seed: int) -> tuple[SpecResult, GenResult]:
    """Speculative and plain decoding of one prompt, each from its own generator of the same seed."""
    device = ids.device
    if opts.get("static") is not None:
        return (opts["static"].speculative(ids, opts["max_new_tokens"], opts["eos"]),
                opts["static"].plain(ids, opts["max_new_tokens"], opts["eos"]))
    spec = speculative_generate(target.model, drafter, target.embed_weight, opts["draft_head"],
                                drafter.config.target_layer_ids, ids, opts["max_new_tokens"], opts["eos"],
                                opts["temperature"], _generator(device, seed), opts["block_size"])
    plain = target_generate(target.model, ids, opts["max_new_tokens"], opts["eos"], opts["temperature"],
                            _generator(device, seed))
    return spec, plain


def _decode_sets(drafter, target, encoded: dict, settings: dict, seed: int, progress: bool, warmup: bool,
                 heartbeat) -> tuple[dict, dict, float]:
    """Every set decoded both ways in the eval's dtype and decoder: (results, the options used, seconds)."""
    dtype = precision.resolve(settings.pop("dtype"), target.dtype, target.embed_weight.device)
    target, drafter = precision.cast_pair(target, drafter, dtype)
    draft_vocab, rows, decoder = settings.pop("draft_vocab"), settings.pop("draft_rows"), settings.pop("decoder")
    opts = {**settings, "dtype": dtype,
            "draft_head": DraftHead.of(target.lm_head_weight, draft_vocab, drafter.config.scaling, rows)}
    opts["static"], opts["decoder_note"] = _static_decoder(decoder, drafter, target, opts)
    if warmup:  # the first prompt; with the fixed-shape decoder, one of each bucket and padded prefill (captures)
        for ids in _warm_up_prompts(encoded, opts["static"]):
            _decode_both(drafter, target, ids, opts, seed)
    t0 = time.perf_counter()
    results = _run_sets(drafter, target, encoded, opts, seed, progress, heartbeat)
    return results, opts, time.perf_counter() - t0


def _warm_up_prompts(encoded: dict, static: StaticDecoder | None) -> list[torch.Tensor]:
    prompts = [ids for set_prompts in encoded.values() for ids in set_prompts]
    if static is None:
        return prompts[:1]
    firsts = {}
    for ids in prompts:
        firsts.setdefault(static.shapes_of(ids.shape[1]), ids)
    return list(firsts.values())


def _static_decoder(setting: str, drafter, target, opts: dict) -> tuple[StaticDecoder | None, str]:
    """The fixed-shape decoder where `eval.decoder` asks for it and the pair allows it, and what decodes."""
    use = setting == "static" or (setting == "auto" and target.embed_weight.device.type == "cuda")
    if not use:
        return None, f"dynamic (eval.decoder={setting})"
    reason = static_reason(target.model, drafter, opts["temperature"])
    if reason is not None:
        return None, f"dynamic: {reason}"
    decoder = StaticDecoder(target.model, drafter, target.embed_weight, opts["draft_head"],
                            drafter.config.target_layer_ids, opts["block_size"], opts["max_new_tokens"])
    return decoder, "static (CUDA graphs)" if decoder.use_graph else "static (eager)"


def _run_sets(drafter, target, encoded: dict[str, list[torch.Tensor]], opts: dict, seed: int,
              progress: bool, heartbeat=None) -> dict[str, tuple[list[SpecResult], list[GenResult]]]:
    """Decode every prompt of every set, with a progress bar showing both decoders' tokens/s."""
    results: dict[str, tuple[list[SpecResult], list[GenResult]]] = {}
    total = sum(len(v) for v in encoded.values())
    spec_tok = spec_s = plain_tok = plain_s = 0.0
    with tqdm(total=total, desc="eval", unit="prompt", disable=not progress, dynamic_ncols=True) as bar:
        for name, prompts in encoded.items():
            spec_list, plain_list = [], []
            for i, ids in enumerate(prompts):
                spec, plain = _decode_both(drafter, target, ids, opts, seed + i)
                spec_list.append(spec)
                plain_list.append(plain)
                spec_tok, spec_s = spec_tok + len(spec.tokens), spec_s + spec.seconds
                plain_tok, plain_s = plain_tok + len(plain.tokens), plain_s + plain.seconds
                bar.set_postfix_str(f"{name} tau {spec.tau:.2f} spec {spec_tok / max(spec_s, 1e-9):.1f} tok/s "
                                    f"target {plain_tok / max(plain_s, 1e-9):.1f} tok/s")
                bar.update(1)
                if heartbeat is not None:  # a slow machine's eval is progress, not a stall
                    heartbeat(f"real eval: {name} prompt {i + 1}/{len(prompts)}")
            results[name] = (spec_list, plain_list)
    return results


def evaluate(drafter: DFlashDrafter, target, prompt_sets: dict[str, list[list[dict]]], *,
             max_new_tokens: int = 128, temperature: float = 0.0, thinking: bool | None = None,
             block_size: int | None = None, seed: int = 0, out_dir: str | Path | None = None,
             progress: bool = True, warmup: bool = True, heartbeat=None, simulate=None,
             draft_vocab: torch.Tensor | None = None, draft_rows: torch.Tensor | None = None,
             text_prompt_tokens: int = DataConfig.text_prompt_tokens,
             near_tie_gap: float = EvalConfig.near_tie_gap,
             near_tie_gap_float32: float = EvalConfig.near_tie_gap_float32,
             decoder: str = EvalConfig.decoder, dtype: str = EvalConfig.dtype) -> dict:
    """Real speculative decoding vs plain target decoding on each prompt set (`heartbeat(stage)`, e.g.
    the watchdog's beat, is called after every prompt).

    `target` is a `dflash_train.model.target.target.Target`; `drafter` an unwrapped `DFlashDrafter` on any
    device (taps and embeddings are moved to it). Returns the report: {"sets": {name: figures},
    "overall": figures pooled over all sets, settings...}; with `out_dir`, also writes
    report.json and the PNG plots there. `simulate(sequences)`, given a set's (prompt ids,
    speculative output ids) pairs, returns the simulated acceptance on that very text ({"sim_tau": the
    decode walk, "sim_tau_anchors": per anchor}; `train/watch/simulate.py`), kept in the set's figures: the
    train/serve check (a gap means the decode loop and training disagree). `draft_vocab` [V'] restricts
    the drafts to those token ids (spec_decode.DraftHead; the output is the same), scored with `draft_rows` [V', H]
    (a directory's own reduced lm_head, as vLLM drafts) or else the target's rows at them. Text sets' documents
    are cut after `text_prompt_tokens` tokens (`data.text_prompt_tokens`). Greedy outputs that leave plain
    decoding other than at an explained near-tie (`eval/lossless.py`, `near_tie_gap*`) raise `LosslessError`
    after the report is written. `decoder` (`eval.decoder`) picks the fixed-shape loops or the dynamic ones;
    `dtype` (`eval.dtype`) the precision both decode in (`eval/precision.py`: a cast copy where it differs).
    """
    check_compatible(drafter, target)
    block_size = block_size or drafter.config.block_size
    device = target.embed_weight.device
    eos = eos_token_ids(target.tokenizer, target.model)
    encoded = {name: encode_prompts(target.tokenizer, prompts, thinking, device, text_prompt_tokens)
               for name, prompts in prompt_sets.items() if prompts}
    if not encoded:
        raise ValueError("no prompts to evaluate")
    was_training = drafter.training
    drafter.eval()
    try:
        results, opts, seconds = _decode_sets(drafter, target, encoded, dict(
            max_new_tokens=max_new_tokens, eos=eos, temperature=temperature, block_size=block_size,
            draft_vocab=draft_vocab, draft_rows=draft_rows, decoder=decoder, dtype=dtype), seed, progress, warmup,
            heartbeat)
    finally:
        drafter.train(was_training)
    report = _assemble(results, block_size, drafter.drafted(block_size), opts, thinking, seed, seconds)
    if simulate is not None:  # the train/serve check: simulated acceptance on the text just decoded
        for name, (spec, _) in results.items():
            # the speculative output, on which real tau was measured: in bf16 it can leave plain greedy's
            # text at a near-tie, and acceptance on another text would not compare
            report["sets"][name].update(simulate([(ids[0].tolist(), r.tokens) for ids, r in
                                                  zip(encoded[name], spec)]))
    report["decoder"] = opts["decoder_note"]
    report["target"], report["device"] = getattr(target, "name", "?"), str(device)
    report["dtype"] = str(opts["dtype"]).removeprefix("torch.")  # the decoders'; bf16 may flip near-tie tokens
    report["draft_vocab"] = int(draft_vocab.numel()) if draft_vocab is not None else None  # None: the whole lm_head
    cfg = drafter.config
    report["drafter"] = {"num_layers": cfg.num_layers, "block_size": cfg.block_size,
                         "target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id}
    tol = lossless.tolerance(opts["dtype"], near_tie_gap, near_tie_gap_float32)
    verdict = lossless.check(results, tol, temperature)
    lossless.apply(report, verdict, tol)
    if out_dir is not None:
        out = Path(out_dir)
        report["plots"] = [str(p) for p in rep.plot(report["sets"], out)]
        if calibration.plot(report["sets"], out / calibration.RELIABILITY_PNG):
            report["plots"].append(str(out / calibration.RELIABILITY_PNG))
        report["report"] = str(rep.write_json(report, out))
    lossless.raise_on_failures(verdict, report.get("report"))  # the evidence is on disk first
    return report


def _assemble(results: dict, block_size: int, drafted: int, opts: dict, thinking: bool | None, seed: int,
              seconds: float) -> dict:
    """The report; acceptance runs 0..drafted per step (DSpark drafts a whole block: drafted = B)."""
    sets = {name: rep.summarize(spec, plain, drafted + 1) for name, (spec, plain) in results.items()}
    all_spec = [r for spec, _ in results.values() for r in spec]
    all_plain = [r for _, plain in results.values() for r in plain]
    return {
        "block_size": block_size,
        "drafted_per_step": drafted,
        "max_new_tokens": opts["max_new_tokens"],
        "temperature": opts["temperature"],
        "thinking": thinking,
        "seed": seed,
        "eos_token_ids": sorted(opts["eos"]),
        "wall_seconds": seconds,
        "sets": sets,
        "overall": rep.summarize(all_spec, all_plain, drafted + 1),
    }
