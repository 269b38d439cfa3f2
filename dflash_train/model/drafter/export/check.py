"""The serving contract of an exported drafter: what vLLM and SGLang need and do not check.

Neither engine notices a missing weight (vLLM's DFlash `load_weights` returns nothing, so its
strict check is skipped; SGLang skips unknown names), vLLM falls back silently on a hidden size or
vocabulary that differs from the target's, and vLLM never reads `block_size`. So a wrong drafter
serves random or misplaced weights without a word. `check_drafter` verifies, and returns every
failure (each naming its field) rather than stopping at the first:
- config: architecture, model_type, `mask_token_id` in [0, vocab), `target_layer_ids` strictly
  increasing in [0, L-2] and as many as `fc` takes, `num_target_layers`, one `block_size`,
  explicit `head_dim`/`rope_theta`/`layer_types` that the engines read as the trainer did (and
  equal to training when the trained drafter is given), hidden size and vocab equal to the
  target's;
- placement: each key of the drafter's architecture where vLLM and SGLang read it, with the value it
  was trained with, and nothing an engine refuses (model/drafter/export/engine_rules.py, one rule per engine and key,
  each naming the engine code it mirrors); a failure names the engines that would refuse the drafter
  (`Failure.refused_by`);
- weights: the exact key set and shapes, no `model.` prefix, no embeddings / lm_head / token maps
  but a reduced draft vocabulary's own lm_head and d2t (model/drafter/export/draft_vocab.py: `draft_vocab_size`
  where vLLM reads it, d2t mapping each draft id to its own token inside the vocabulary, the lm_head rows the
  target's at those tokens); every float tensor in the dtype config.json declares, and finite;
- scaling: `dflash_config.input_embedding_scale`, `output_multiplier` and `final_logit_softcapping`
  are values an engine can apply and equal the target's own (model/target/scaling.py); which engines ignore
  them is said beside the verdict (`engine_notes`);
- target: the one given is the one recorded at export (`dflash_config.trained_against`);
- forward: one block through the drafter loaded the engines' way (`engine_view`) equals the
  trainer's forward, hidden states and draft logits.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.model.drafter.export import engine_view
from dflash_train.model.drafter.heads.architectures import build_drafter, head, head_of_config
from dflash_train.model.drafter.export.engine_rules import READS, check_placement as engine_placement, expected_keys
from dflash_train.model.drafter.attention import MaskSpec, build_training_masks
from dflash_train.model.drafter.config import DrafterConfig, last_layer_tap_problem, rope_theta_of
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.drafter.head import SGLANG
from dflash_train.model.drafter.export import draft_vocab
from dflash_train.model.drafter.export.hf_format import TRAINED_AGAINST, drafter_config_from_zlab, load_zlab
from dflash_train.model.target.scaling import Scaling, scale_embeddings, scale_logits, scaling_problems, target_scaling
from dflash_train.model.target.identity import TargetInfo, safetensors_shapes, serve_note

FORBIDDEN_WEIGHTS = ("embed_tokens.weight", "lm_head.weight", "t2d", "d2t")
EXPLICIT_KEYS = ("head_dim", "rope_theta", "layer_types")
ENGINE_FIELDS = {  # engine (Qwen3Config) attribute -> trainer (DrafterConfig) field
    "hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps", "layer_types": "layer_types", "attention_bias": "attention_bias",
}
CONTEXT_LEN = 5  # context positions before the checked block
LOGIT_ROWS = 64  # random lm_head rows the checked draft logits are scored with
FORWARD_RTOL = 1e-4


@dataclass(frozen=True)
class Failure:
    field: str
    message: str
    refused_by: tuple[str, ...] = ()
    """The engines that would refuse to load the drafter for it (model/drafter/export/engine_rules.py); the others
    load it and serve it wrong."""

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class ServingContractError(ValueError):
    def __init__(self, drafter_dir, failures: list[Failure], written: bool = True):
        self.failures = failures
        lines = "\n  ".join(str(f) for f in failures)
        where = "" if written else " (checked before it was swapped in: nothing was written there)"
        super().__init__(f"{drafter_dir}: the drafter fails its serving check{where} ({len(failures)} problems):"
                         f"\n  {lines}")


def check_drafter(drafter_dir: str | Path, target: TargetInfo | None = None,
                  trained: DFlashDrafter | None = None, target_lm_head: torch.Tensor | None = None) -> list[Failure]:
    """Every way the drafter in `drafter_dir` would be served wrong; [] when none.

    target: the target it will be served with (`describe_target`). trained: the trainer's drafter
    that was exported (its config is "training"; its weights, rounded to the stored dtype, give the
    reference forward); without it the trainer's loader `load_zlab` reads the directory. target_lm_head: the
    target's lm_head, where the caller holds it (else read from `target` for a reduced draft vocabulary)."""
    drafter_dir = Path(drafter_dir)
    try:
        d = json.loads((drafter_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        return [Failure("config.json", f"cannot be read: {e}")]
    weight_files = sorted(drafter_dir.glob("*.safetensors"))
    if not weight_files:
        return [Failure("weights", f"no *.safetensors in {drafter_dir}")]
    shapes = {name: shape for path in weight_files for name, shape in safetensors_shapes(path).items()}
    failures = check_config(d, shapes, target)
    identity = check_target_identity(d, target) if target is not None else []
    try:
        cfg = drafter_config_from_zlab(d, str(drafter_dir / "config.json"))
    except (ValueError, TypeError) as e:
        return failures + [Failure("config", f"the trainer cannot read it: {e}")] + identity
    reduced = draft_vocab.served_rows(shapes, cfg)
    failures += check_engines(cfg) + check_engine_view(drafter_dir, d, cfg)
    failures += check_placement(d, trained.config if trained is not None else cfg, reduced)
    if trained is not None:
        failures += check_training(cfg, trained.config)
    failures += check_weights(shapes, cfg, skip_fc=any(f.field.endswith("target_layer_ids") for f in failures),
                              reduced=reduced is not None)
    failures += check_tensors(weight_files, d) + check_draft_vocab(drafter_dir, d, cfg, reduced, target, target_lm_head)
    if not failures:  # a forward needs loadable weights and a config both sides read alike
        failures += check_forward(drafter_dir, d, cfg, trained)
    return failures + identity


def check_config(d: dict, shapes: dict, target: TargetInfo | None) -> list[Failure]:
    """The config keys the engines act on, as they read them."""
    out = []
    try:
        head_of_config(d)
    except ValueError as e:
        out.append(Failure("architectures", f"{e}: vLLM and SGLang pick their drafter class by this name"))
    if d.get("model_type") != "qwen3":
        out.append(Failure("model_type", f"{d.get('model_type')!r} is not 'qwen3': the engines parse the "
                                         "config as a Qwen3Config"))
    dflash = d.get("dflash_config")
    if not isinstance(dflash, dict):
        return out + [Failure("dflash_config", "missing: the engines read mask_token_id and target_layer_ids "
                                               "from it (SGLang falls back to derived layer ids)")]
    out += _check_vocab_and_mask(d, dflash, target)
    out += _check_layer_ids(d, dflash, shapes, target)
    out += _check_block_size(d, dflash)
    out += _check_scaling(d, dflash, target)
    if target is not None and d.get("hidden_size") != target.hidden_size:
        out.append(Failure("hidden_size", f"{d.get('hidden_size')} but the target {target.name} has "
                                          f"{target.hidden_size}: vLLM silently falls back, SGLang raises", (SGLANG,)))
    return out


def check_engines(cfg: DrafterConfig) -> list[Failure]:
    """A drafter no engine serves (its head's `Engine`s, with the refusals of its settings) is for training
    and our eval only: exporting or checking it for serving fails, naming each engine's reason."""
    served = head(cfg.arch).served(cfg)
    if any(not e.refused for e in served):
        return []
    why = "; ".join(f"{e.name}: {e.refused}" for e in served)
    return [Failure("architectures", f"no engine serves this {cfg.arch} drafter ({why}): it trains and evaluates "
                                     "here only", tuple(e.name for e in served))]


def _check_vocab_and_mask(d: dict, dflash: dict, target: TargetInfo | None) -> list[Failure]:
    out, vocab = [], d.get("vocab_size")
    if target is not None and vocab != target.vocab_size:
        out.append(Failure("vocab_size", f"{vocab} but the target {target.name} has {target.vocab_size} "
                                         "embedding rows: vLLM silently skips the embedding and token maps"))
    mask = dflash.get("mask_token_id")
    limits = [v for v in (vocab, target.vocab_size if target else None) if isinstance(v, int)]
    if not isinstance(mask, int) or isinstance(mask, bool):
        out.append(Failure("dflash_config.mask_token_id", f"{mask!r} is not an integer token id"))
    elif mask < 0 or any(mask >= v for v in limits):
        out.append(Failure("dflash_config.mask_token_id", f"{mask} is outside the embedding table "
                                                          f"[0, {min(limits) if limits else '?'})"))
    return out


def _check_layer_ids(d: dict, dflash: dict, shapes: dict, target: TargetInfo | None) -> list[Failure]:
    field, out = "dflash_config.target_layer_ids", []
    ids, n_target = dflash.get("target_layer_ids"), d.get("num_target_layers")
    if target is not None and n_target != target.num_layers:
        out.append(Failure("num_target_layers", f"{n_target} but the target {target.name} has {target.num_layers}"))
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        return out + [Failure(field, f"{ids!r} is not a non-empty list of layer ids (SGLang would derive "
                                     "its own, vLLM would tap nothing sensible)")]
    if any(b <= a for a, b in zip(ids, ids[1:])):
        out.append(Failure(field, f"{ids} is not strictly increasing"))
    for n_layers in {n for n in (n_target, target.num_layers if target else None) if isinstance(n, int)}:
        last_tap = last_layer_tap_problem(ids, n_layers)
        if last_tap:
            out.append(Failure(field, last_tap))
        elif any(not 0 <= i <= n_layers - 2 for i in ids):
            out.append(Failure(field, f"{ids} outside [0, {n_layers - 2}] for a target of {n_layers} layers"))
    fc, hidden = shapes.get("fc.weight") or shapes.get("model.fc.weight"), d.get("hidden_size")
    if fc and isinstance(hidden, int) and len(fc) == 2 and fc[1] != len(ids) * hidden:
        out.append(Failure(field, f"{len(ids)} ids but fc.weight {list(fc)} takes {fc[1] / hidden:g} taps "
                                  f"of width {hidden}"))
    return out


def _check_block_size(d: dict, dflash: dict) -> list[Failure]:
    found = {k: v for k, v in (("block_size", d.get("block_size")),
                               ("dflash_config.block_size", dflash.get("block_size"))) if v is not None}
    if not found:
        return [Failure("block_size", "missing (top level and dflash_config): serve with "
                                      "num_speculative_tokens = block_size - 1, so it must be recorded")]
    if len(set(found.values())) > 1:
        return [Failure("block_size", f"differs between places: {found} (SGLang reads dflash_config's, the "
                                      "serve commands the top level)")]
    size = next(iter(found.values()))
    if not isinstance(size, int) or size < 2:
        return [Failure("block_size", f"{size!r}: must be an integer >= 2")]
    return []


def drafter_scaling(d: dict, dflash: dict) -> dict:
    """The three scaling fields as z-lab's `dflash` reads them (dflash_config, then top level, else identity)."""
    return {k: dflash.get(k, d.get(k, v)) for k, v in Scaling().as_dict().items()}


_SCALING_WHAT = {"input_embedding_scale": "scales its input embeddings by",
                 "output_multiplier": "multiplies its logits by", "final_logit_softcapping": "soft-caps its logits at"}


def _check_scaling(d: dict, dflash: dict, target: TargetInfo | None) -> list[Failure]:
    """Values an engine can apply, equal to the target's own scaling (read from its config)."""
    values = drafter_scaling(d, dflash)
    out = [Failure(f"dflash_config.{name}", f"{why}: no engine can apply it (vLLM and SGLang reject it)")
           for name, why in scaling_problems(values)]
    if out or target is None:
        return out
    text_cfg = target_text_config(target.path)
    expected = target_scaling(text_cfg).as_dict()
    kind = text_cfg.get("model_type") if isinstance(text_cfg, dict) else getattr(text_cfg, "model_type", "?")
    for name, want in expected.items():
        got = values[name]
        if not same_value(got, want):
            out.append(Failure(f"dflash_config.{name}", f"{got} but the target {target.name} ({kind}) "
                               f"{_SCALING_WHAT[name]} {want}: the drafter was trained for other block embeddings "
                               "or logits than this target gives it"))
    return out


def same_value(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(float(a) - float(b)) <= 1e-6 * max(abs(float(b)), 1.0)


def target_text_config(hf_dir: str):
    """A target directory's text config, defaults filled in (`save_pretrained` leaves out values equal to
    the class's defaults, e.g. Gemma 2's soft cap of 30); its config.json dict where transformers cannot
    parse it (remote code)."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
        return getattr(cfg, "text_config", None) or cfg
    except (ValueError, OSError, KeyError):
        config = json.loads((Path(hf_dir) / "config.json").read_text())
        return config.get("text_config") or config


def check_placement(d: dict, cfg: DrafterConfig, draft_vocab_size: int | None = None) -> list[Failure]:
    """Each key of the drafter's head where vLLM and SGLang read it, with the value it was trained with
    (model/drafter/export/engine_rules.py: one rule per engine and key, each citing the engine code it mirrors), and
    `draft_vocab_size` where the weights carry a reduced draft vocabulary of that many rows. A key
    the head writes that no engine rule covers (a head only one engine's loader reads, such as Domino's)
    must be where the head's `Export` puts it, with the value it was trained with."""
    export = head(cfg.arch).export
    expected = expected_keys(export, cfg, draft_vocab_size)
    out = [Failure(f.field, f.message, f.refused_by) for f in engine_placement(d, expected)]
    ruled = {rule.key for rule in READS}
    where, prefix = (d, "") if export.top_level else (d.get("dflash_config") or {}, "dflash_config.")
    for key in export.written():
        if key in ruled:
            continue
        if key not in where:
            out.append(Failure(prefix + key, "missing: the engines that serve this head read it there"))
        elif where[key] != expected[key]:
            out.append(Failure(prefix + key, f"{where[key]!r} but the drafter was trained with {expected[key]!r}: "
                                             "the engines would build another head"))
    return out


INTEGER_DTYPES = ("I64", "I32", "I16", "I8", "U8", "BOOL")
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def check_tensors(weight_files: list[Path], d: dict) -> list[Failure]:
    """Every tensor in the dtype config.json declares (the engines cast each one into a parameter of the
    model's dtype, vLLM model_loader/weight_utils.py default_weight_loader and SGLang's alike, so a
    float16 tensor in a bfloat16 export is served rounded twice without a word) and finite."""
    from safetensors import safe_open

    declared = d.get("dtype") or d.get("torch_dtype")
    wrong, bad = [], []
    for path in weight_files:
        for name, dtype in _header_dtypes(path).items():  # integer tensors (d2t) are not cast to the model's dtype
            if declared and dtype not in INTEGER_DTYPES and SAFETENSORS_DTYPES.get(dtype, dtype) != declared:
                wrong.append(f"{name} is {SAFETENSORS_DTYPES.get(dtype, dtype)}")
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    bad.append(f"{name} ({path.name})")
    out = []
    if wrong:
        out.append(Failure("weights.dtype", f"{'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''} but config.json "
                           f"says dtype {declared}: the engines cast it without a word, so what is served is not what "
                           "was exported; export again (`dflash-train export --dtype ...`)"))
    if bad:
        out.append(Failure("weights.non_finite", f"{', '.join(bad[:4])} hold NaN or inf: both engines load them "
                           "without a word and the drafter proposes garbage; export a finite checkpoint"))
    return out


def _header_dtypes(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype string, from the file's JSON header alone."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {name: meta["dtype"] for name, meta in header.items() if name != "__metadata__"}


def check_engine_view(drafter_dir: Path, d: dict, cfg: DrafterConfig) -> list[Failure]:
    """The engines' fresh parse must give the values the trainer used; the keys whose defaults
    differ between the two (head_dim 128, rope_theta 10000 in Qwen3Config) must be explicit."""
    has_theta = "rope_theta" in d or "rope_theta" in (d.get("rope_parameters") or {})
    out = [Failure(key, "not in config.json: the engines would use Qwen3Config's default, not the trainer's")
           for key in EXPLICIT_KEYS if not (has_theta if key == "rope_theta" else key in d)]
    try:
        hf = engine_view.engine_config(drafter_dir)
    except (ValueError, TypeError, OSError) as e:
        return out + [Failure("config", f"transformers' Qwen3Config cannot parse it: {e}")]
    explicit_missing = {f.field for f in out}
    engine = {k: getattr(hf, k, None) for k in ENGINE_FIELDS} | {"rope_theta": rope_theta_of(hf)}
    trainer = {k: getattr(cfg, v) for k, v in ENGINE_FIELDS.items()} | {"rope_theta": cfg.rope_theta}
    engine["layer_types"] = tuple(engine["layer_types"] or ())
    if "sliding_attention" in cfg.layer_types:
        engine["sliding_window"], trainer["sliding_window"] = getattr(hf, "sliding_window", None), cfg.sliding_window
    for key in engine:
        if key not in explicit_missing and engine[key] != trainer[key]:
            out.append(Failure(key, f"the engines read {engine[key]!r}, the trainer {trainer[key]!r}"))
    return out + (_check_rotary(hf, cfg) if "head_dim" not in explicit_missing else [])


def engine_rotary_dim(hf) -> int:
    """The dimensions of each head an engine rotates for this config: head_dim x `partial_rotary_factor`
    (vLLM's `get_rope(rotary_dim=...)`), the factor read at the top level or, as transformers 5 keeps it,
    in `rope_parameters` (transformers' own Qwen3 rotary embedding ignores it: no reference here)."""
    params = getattr(hf, "rope_parameters", None) or {}
    factor = getattr(hf, "partial_rotary_factor", None) or (params.get("partial_rotary_factor")
                                                            if isinstance(params, dict) else None) or 1.0
    return int(hf.head_dim * float(factor))


def _check_rotary(hf, cfg: DrafterConfig) -> list[Failure]:
    """Published pitfall 4 (speculators #613): a partial rotary factor copied from the target makes
    the engines rotate part of each head while training rotated all of it (`drafter.apply_rope`)."""
    try:
        rotated = engine_rotary_dim(hf)
    except (AttributeError, TypeError, ValueError) as e:
        return [Failure("partial_rotary_factor", f"unreadable: {e}")]
    if rotated != cfg.head_dim:
        return [Failure("partial_rotary_factor", f"the engines rotate {rotated} of each head's {cfg.head_dim} "
                                                 "dimensions; the drafter was trained rotating all of them")]
    return []


def check_training(cfg: DrafterConfig, trained: DrafterConfig) -> list[Failure]:
    """The written config reads back as the config the drafter was trained with."""
    out = []
    for f in dataclasses.fields(DrafterConfig):
        if f.compare and getattr(cfg, f.name) != getattr(trained, f.name):
            out.append(Failure(f"training.{f.name}", f"config.json says {getattr(cfg, f.name)!r} but the drafter "
                                                     f"was trained with {getattr(trained, f.name)!r}"))
    return out


def check_weights(shapes: dict, cfg: DrafterConfig, skip_fc: bool = False, reduced: bool = False) -> list[Failure]:
    """Exact key set and shapes, as stored (`model.` prefix and shared tensors are failures, but the lm_head and
    d2t of a `reduced` draft vocabulary, which `check_draft_vocab` checks)."""
    out = []
    prefixed = sorted(n for n in shapes if n.startswith(engine_view.SKIPPED_PREFIX))
    if prefixed:
        out.append(Failure("weights.prefix", f"{len(prefixed)} tensors carry a `model.` prefix (e.g. {prefixed[0]}): "
                                             "the z-lab format has none"))
    plain = {n.removeprefix(engine_view.SKIPPED_PREFIX): s for n, s in shapes.items()}
    own = (draft_vocab.LM_HEAD, draft_vocab.D2T) if reduced else ()
    shared = sorted(n for n in plain if n.endswith(FORBIDDEN_WEIGHTS) and n not in own)
    if shared:
        out.append(Failure("weights.shared", f"carries {shared}: vLLM would use them instead of the target's "
                                             "embedding and lm_head, SGLang ignores them"))
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build_drafter(cfg).state_dict().items()}
    missing = sorted(set(expected) - set(plain))
    unexpected = sorted(set(plain) - set(expected) - set(shared) - set(own))
    if missing:
        out.append(Failure("weights.missing", f"{missing[:8]}{' ...' if len(missing) > 8 else ''} "
                                              f"({len(missing)}): neither engine checks, both would serve random "
                                              "weights there"))
    if unexpected:
        out.append(Failure("weights.unexpected", f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}: "
                                                 "unknown names, which the engines skip"))
    wrong = [f"{n} {list(plain[n])} (config implies {list(s)})" for n, s in expected.items()
             if n in plain and plain[n] != s and not (skip_fc and n == "fc.weight")]
    if wrong:
        out.append(Failure("weights.shape", "; ".join(wrong[:4])))
    return out


def check_draft_vocab(drafter_dir: Path, d: dict, cfg: DrafterConfig, reduced: int | None, target: TargetInfo | None,
                      target_lm_head: torch.Tensor | None) -> list[Failure]:
    """A reduced draft vocabulary (`reduced` rows of lm_head, or None) as vLLM reads it
    (model/drafter/export/draft_vocab.py `served_form_problems`), its lm_head rows compared with the target's where
    the target is given; nothing for a whole-vocabulary drafter."""
    if target_lm_head is None and target is not None and reduced is not None:
        from dflash_train.model.target.subset import read_lm_head  # reads the target's lm_head only

        stored = draft_vocab.read_tensor(draft_vocab.tensor_files(drafter_dir)[draft_vocab.LM_HEAD]).dtype
        target_lm_head = read_lm_head(target.path, stored)
    return [Failure(field, message) for field, message in
            draft_vocab.served_form_problems(drafter_dir, d, cfg, target_lm_head)]


def check_target_identity(d: dict, target: TargetInfo) -> list[Failure]:
    """The target given is the one recorded at export (nothing to compare for a drafter without
    a record, e.g. a published one)."""
    rec = (d.get("dflash_config") or {}).get(TRAINED_AGAINST)
    if not isinstance(rec, dict):
        return []
    out = []
    trained = f"{rec.get('name')} ({rec.get('quantization') or 'unquantised'}, {rec.get('path')})"
    if rec.get("config_sha256") != target.config_sha256:
        out.append(Failure("target.config", f"{target.name} ({target.path}) has config {target.config_sha256}, the "
                                            f"drafter was trained against {trained}: {rec.get('config_sha256')}"))
    if rec.get("weights_fingerprint") != target.weights_fingerprint:
        out.append(Failure("target.weights", f"{target.name} ({target.path}) is not the model the drafter was "
                                             f"trained against ({trained}): {serve_note(rec)}"))
    return out


def check_forward(drafter_dir: Path, d: dict, cfg: DrafterConfig, trained: DFlashDrafter | None) -> list[Failure]:
    """One block after CONTEXT_LEN positions: the engines' view equals the trainer's training forward."""
    from safetensors.torch import load_file

    tensors = {n: t for path in sorted(drafter_dir.glob("*.safetensors")) for n, t in load_file(str(path)).items()}
    stored_dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
    if trained is None:
        ours = load_zlab(drafter_dir, dtype=torch.float32)
    else:  # the exported weights are the trained ones rounded to the stored dtype
        ours = copy.deepcopy(trained).to("cpu", stored_dtype).float()
    gen = torch.Generator().manual_seed(0)
    B, C, H = cfg.block_size, CONTEXT_LEN, cfg.hidden_size
    taps = torch.randn(1, C + 1, cfg.num_taps * H, generator=gen)  # the anchor's own tap is never seen
    rows = torch.randn(1, B, H, generator=gen)  # the block's rows of the embedding table
    head = torch.randn(LOGIT_ROWS, H, generator=gen)  # some lm_head rows: the draft logits' scaling
    positions = torch.cat([torch.arange(C + 1), C + torch.arange(B)])[None]  # [1, C+1+B]
    masks = build_training_masks(MaskSpec(C + 1, B, 1, cfg.sliding_window, cfg.window_causal), cfg.layer_types,
                                 torch.tensor([[C]]), torch.ones(1, 1, dtype=torch.bool), "dense")
    dflash = d.get("dflash_config") or {}
    with torch.no_grad():
        want = ours(scale_embeddings(rows, cfg.input_embedding_scale), taps, positions, masks, "dense")[0]  # [B, H]
        want_logits = scale_logits(want @ head.T, cfg.output_multiplier, cfg.final_logit_softcapping)
        try:
            hf = engine_view.engine_config(drafter_dir)
            got = engine_view.engine_forward(hf, dflash, engine_view.engine_weights(tensors), taps[0, :C],
                                             engine_view.engine_block_embeds(rows[0], hf, dflash))
            got_logits = engine_view.engine_logits(got, head, hf, dflash)
        except (KeyError, RuntimeError, TypeError, ValueError) as e:
            return [Failure("forward", f"the engines' view of the drafter does not run: {type(e).__name__}: {e}")]
    return _differs("forward", got, want, "the drafter as the engines load it differs from the trainer's forward") \
        or _differs("forward.logits", got_logits, want_logits, "the draft logits as the engines compute them differ "
                    "from the trainer's (dflash_config.output_multiplier / final_logit_softcapping)")


def _differs(field: str, got: torch.Tensor, want: torch.Tensor, what: str) -> list[Failure]:
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    if not err <= FORWARD_RTOL * max(scale, 1.0):
        return [Failure(field, f"{what}: max |diff| {err:.3g} (outputs up to {scale:.3g})")]
    return []
