"""Drafters from the ecosystem: z-lab, speculators and DeepSeek DeepSpec checkpoints read into our classes.

`load_drafter(dir)` reads `config.json`, tells the format by its keys (`detect_format`), converts the
config in memory into the z-lab form `hf_format.drafter_config_from_zlab` reads, and loads the weights
into the drafter class of its architecture (DFlash, DFlash 2, DSpark). Nothing is written. A setting our
classes cannot run as the checkpoint's trainer ran it is refused with the file and the key.

The formats, as their writers write them (read from their code, 2026-12):
- z-lab (`architectures` DFlashDraftModel / DFlash2DraftModel, ours also Qwen3DSparkModel with a
  `dflash_config`): a Qwen3 config with the DFlash keys in `dflash_config` or at the top level.
- speculators 0.9.0 (`speculators_model_type` dflash | dflash2 | dspark; `SpeculatorModel.save_pretrained`):
  the decoder shape in `transformer_layer_config` (a Qwen3Config written as a diff against its defaults,
  so it is read back through transformers' own Qwen3Config), taps as `aux_hidden_state_layer_ids` (HF
  hidden_states indices: z-lab id + 1), `draft_vocab_size`, `block_size`, `mask_token_id`,
  `sliding_window_non_causal` (sliding layers are causal inside the block unless it is true),
  `sample_from_anchor` (DSpark drafts from the anchor's slot, DFlash does not) and the heads' fields at
  the top level; no verifier layer count (the target's is used). Tensor names are ours; the frozen
  `lm_head` is saved only with a reduced draft vocabulary.
- DeepSeek DeepSpec (`Qwen3DSparkModel` without `dflash_config`; deepspec/modeling/dspark/qwen3): the
  target's own config copied, with `block_size`, `target_layer_ids` (z-lab ids; -1 is the embedding
  output), `mask_token_id`, `num_target_layers`, `num_anchors`, `markov_rank`, `markov_head_type`,
  `enable_confidence_head`, `confidence_head_with_markov` at the top level, RoPE in `rope_parameters`,
  every layer full attention; the frozen `embed_tokens` and `lm_head` copies are saved too (unused: the
  target's own are). Its DFlash is this DSpark with `markov_rank` 0 and no confidence head.
A DSpark without a Markov or confidence head (both formats allow it) reads as ours with zeros where drafting
would read them (`_dspark_heads`), said in a note.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

FORMATS = ("zlab", "speculators", "deepspec")
FULL, SLIDING = "full_attention", "sliding_attention"  # model/drafter/attention.py's layer types (that module needs torch)
SPECULATORS_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}
"""speculators_model_type -> the z-lab `architectures` name of the same drafter (model/drafter/heads/architectures.py)."""
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DSPARK_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
FROZEN_COPIES = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
"""Target weights a checkpoint may carry beside the drafter's own: the target's are used instead."""


class UnsupportedDrafter(ValueError):
    """A checkpoint setting our drafter classes cannot run as its trainer did (names file and key)."""

    def __init__(self, source: str, key: str, why: str):
        super().__init__(f"{source}: {key}: {why}")


@dataclass(frozen=True)
class Loaded:
    drafter: object  # model.drafter.DFlashDrafter (or a subclass)
    format: str  # one of FORMATS
    notes: tuple[str, ...] = ()


def detect_format(d: dict) -> str:
    """The format of a drafter config.json (module doc)."""
    if "speculators_model_type" in d:
        return "speculators"
    if "Qwen3DSparkModel" in (d.get("architectures") or []) and "dflash_config" not in d:
        return "deepspec"
    return "zlab"


def read_config(model_dir: str | Path) -> tuple[dict, str]:
    """(config.json as a dict, its path) of a drafter directory; errors name the file."""
    path = Path(model_dir).expanduser() / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json; is this a drafter directory (z-lab, speculators or "
                                "DeepSpec format)?")
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None


def config_problems(model_dir: str | Path) -> list[str]:
    """What refuses the directory's config before anything heavy loads (no torch, no transformers):
    the checks that need no default of the writer's config class."""
    try:
        d, source = read_config(model_dir)
        fmt = detect_format(d)
        if fmt == "speculators":
            _check_speculators(d, source)
        elif fmt == "deepspec":
            _check_deepspec(d, source)
    except (ValueError, FileNotFoundError) as e:
        return [str(e)]
    return []


def _require(d: dict, keys, source: str) -> None:
    for key in keys:
        if d.get(key) is None:
            raise UnsupportedDrafter(source, key, "missing (its writer always sets it)")


def _check_speculators(d: dict, source: str) -> str:
    kind = d["speculators_model_type"]
    if kind not in SPECULATORS_ARCHITECTURES:
        raise UnsupportedDrafter(source, "speculators_model_type", f"{kind!r} is not a drafter of the DFlash family "
                                 f"this trainer reads ({', '.join(SPECULATORS_ARCHITECTURES)})")
    _require(d, ("transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id", "block_size",
                 "draft_vocab_size"), source)
    if min(d["aux_hidden_state_layer_ids"]) < 1:
        raise UnsupportedDrafter(source, "aux_hidden_state_layer_ids", f"{d['aux_hidden_state_layer_ids']} taps the "
                                 "embedding output (0), which no DFlash drafter of this trainer reads")
    from_anchor = d.get("sample_from_anchor", kind == "dspark")  # the config classes' defaults
    if from_anchor != (kind == "dspark"):
        raise UnsupportedDrafter(source, "sample_from_anchor", f"{from_anchor} on a {kind} drafter: this trainer's "
                                 f"{kind} drafts from the anchor's slot {'only' if kind == 'dspark' else 'never'}")
    return kind


def _check_deepspec(d: dict, source: str) -> None:
    _require(d, ("block_size", "target_layer_ids", "mask_token_id", "num_target_layers"), source)
    if -1 in d["target_layer_ids"]:
        raise UnsupportedDrafter(source, "target_layer_ids", f"{d['target_layer_ids']}: -1 taps the embedding output, "
                                 "which no DFlash drafter of this trainer reads")
    if d.get("enable_confidence_head") and d.get("confidence_head_with_markov") is None:
        raise UnsupportedDrafter(source, "confidence_head_with_markov", "missing with enable_confidence_head true")


def _rope_theta(config, source: str, where: str = "") -> float:
    """The plain RoPE base of a config (object or dict): refused where it scales or rotates part of a head,
    which our drafters (and the engines' DFlash drafters) never do."""
    from dflash_train.model.drafter.config import rope_theta_of

    get = config.get if isinstance(config, dict) else (lambda k, default=None: getattr(config, k, default))
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5 / 4 (5 aliases the second to the first)
        params = get(key)
        if not isinstance(params, dict):
            continue
        if FULL in params:
            raise UnsupportedDrafter(source, f"{where}{key}", "a RoPE per layer type: a drafter has one")
        kind = params.get("rope_type", params.get("type"))
        if kind not in (None, "default"):
            raise UnsupportedDrafter(source, f"{where}{key}.rope_type", f"{kind!r}: only plain RoPE is read")
        partial = params.get("partial_rotary_factor") or 1.0
        if float(partial) != 1.0:
            raise UnsupportedDrafter(source, f"{where}{key}.partial_rotary_factor",
                                     f"{partial}: our drafters rotate whole heads")
    if float(get("partial_rotary_factor") or 1.0) != 1.0:
        raise UnsupportedDrafter(source, f"{where}partial_rotary_factor",
                                 f"{get('partial_rotary_factor')}: our drafters rotate whole heads")
    ns = config if not isinstance(config, dict) else SimpleNamespace(**config)
    return rope_theta_of(ns)


def _check_act(act, source: str, key: str) -> None:
    if act not in (None, "silu"):
        raise UnsupportedDrafter(source, key, f"{act!r}: our drafters' MLP is SwiGLU (silu)")


def _dspark_heads(d: dict) -> tuple[dict, tuple[str, ...]]:
    """Our DSpark's head keys for a checkpoint's, and the heads it lacks, which drafting reads as ours with zeros:
    no Markov head is a zero bias (rank 1, W2 = 0); no confidence head is never read when drafting; one that
    reads the hidden state alone is ours with zero weights on the Markov input. (DeepSpec's DFlash is such a
    DSpark: drafting from the anchor's slot, with neither head.)"""
    rank = d.get("markov_rank", 256)  # speculators' default; DeepSpec always writes it
    keys = {"markov_rank": rank or 1, "markov_head_type": d.get("markov_head_type", "vanilla") if rank else "vanilla",
            "enable_confidence_head": True, "confidence_head_with_markov": True, "sample_from_anchor": True}
    fills = () if rank else ("markov",)
    if not d.get("enable_confidence_head", True):
        fills += ("confidence",)
    elif not (rank and d.get("confidence_head_with_markov", True)):
        fills += ("confidence_markov_input",)
    return keys, fills


def _layer_config(d: dict, source: str):
    """speculators' `transformer_layer_config` through transformers' own config class (its writer stores a
    diff against that class's defaults, as speculators reads it back: `validate_transformer_config`)."""
    from transformers import AutoConfig

    layer = dict(d["transformer_layer_config"])
    model_type = layer.pop("model_type", "qwen3")
    try:
        return AutoConfig.for_model(model_type, **layer)
    except (ValueError, KeyError, TypeError) as e:
        raise UnsupportedDrafter(source, "transformer_layer_config", f"transformers cannot build it ({e})") from None


def _from_speculators(d: dict, source: str, num_target_layers: int | None) -> dict:
    kind = _check_speculators(d, source)
    if num_target_layers is None:
        raise UnsupportedDrafter(source, "speculators_config.verifier", "the format records no verifier layer "
                                 "count: load the drafter with its target")
    layer = _layer_config(d, source)
    if d["draft_vocab_size"] != layer.vocab_size:
        raise UnsupportedDrafter(source, "draft_vocab_size", f"{d['draft_vocab_size']} of the verifier's "
                                 f"{layer.vocab_size} tokens: a reduced draft vocabulary (t2d/d2t) is not read")
    if d.get("target_hidden_size") not in (None, layer.hidden_size):
        raise UnsupportedDrafter(source, "target_hidden_size", f"{d['target_hidden_size']} differs from the drafter's "
                                 f"{layer.hidden_size}: our drafters run at the target's width")
    _check_act(getattr(layer, "hidden_act", None), source, "transformer_layer_config.hidden_act")
    n = layer.num_hidden_layers
    types = list(getattr(layer, "layer_types", None) or [FULL] * n)
    ids = [i - 1 for i in d["aux_hidden_state_layer_ids"]]  # HF hidden_states index -> z-lab decoder layer id
    zlab = {
        "architectures": [SPECULATORS_ARCHITECTURES[kind]], "model_type": "qwen3", "block_size": d["block_size"],
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": d["mask_token_id"], "target_layer_ids": ids, "block_size": d["block_size"]},
        "hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size, "num_hidden_layers": n,
        "num_attention_heads": layer.num_attention_heads, "num_key_value_heads": layer.num_key_value_heads,
        "head_dim": getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads,
        "rms_norm_eps": layer.rms_norm_eps, "rope_theta": _rope_theta(layer, source, "transformer_layer_config."),
        "attention_bias": bool(getattr(layer, "attention_bias", False)),
        "max_position_embeddings": layer.max_position_embeddings, "layer_types": types,
        "sliding_window": layer.sliding_window if SLIDING in types else None, "vocab_size": layer.vocab_size,
        "bos_token_id": getattr(layer, "bos_token_id", None), "eos_token_id": getattr(layer, "eos_token_id", None),
    }
    if SLIDING in types and d.get("sliding_window_non_causal", kind == "dflash2"):  # the config classes' defaults
        zlab["is_causal"] = False
    if kind == "dflash2":
        zlab["dflash_config"].update({k: d[k] for k in DFLASH2_FIELDS if k in d})
    fills = ()
    if kind == "dspark":
        keys, fills = _dspark_heads(d)
        zlab.update(keys)
    return zlab, fills


def _from_deepspec(d: dict, source: str, num_target_layers: int | None) -> dict:
    _check_deepspec(d, source)
    _check_act(d.get("hidden_act"), source, "hidden_act")
    zlab = {k: v for k, v in d.items() if k not in ("rope_parameters", "rope_scaling", *DSPARK_FIELDS)}
    zlab["rope_theta"] = _rope_theta(d, source)
    zlab.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    keys, fills = _dspark_heads({**d, "enable_confidence_head": d.get("enable_confidence_head", False)})
    return {**zlab, **keys}, fills  # DeepSpec's slot k drafts anchor + k + 1 (its label offsets 1..B)


def _from_zlab(d: dict, source: str, num_target_layers: int | None) -> dict:
    """Ours and z-lab's: as written, with RoPE read from `rope_parameters` where a transformers 5 writer
    put it there alone."""
    return {**d, "rope_theta": _rope_theta(d, source)}, ()


CONVERTERS = {"zlab": _from_zlab, "speculators": _from_speculators, "deepspec": _from_deepspec}


def zlab_config(d: dict, source: str = "config.json", num_target_layers: int | None = None) -> dict:
    """Any format's config dict converted into the z-lab form `hf_format.drafter_config_from_zlab` reads."""
    return CONVERTERS[detect_format(d)](d, source, num_target_layers)[0]


def load_drafter(model_dir: str | Path, num_target_layers: int | None = None, device="cpu", dtype=None) -> Loaded:
    """The drafter of a directory in any of FORMATS, in our class of its architecture (module doc).
    `num_target_layers`: the target's, which the speculators format does not record."""
    from dflash_train.model.drafter.export.hf_format import drafter_config_from_zlab

    d, source = read_config(model_dir)
    fmt = detect_format(d)
    zlab, fills = CONVERTERS[fmt](d, source, num_target_layers)
    try:
        cfg = drafter_config_from_zlab(zlab, source)
    except ValueError as e:  # DrafterConfig's own checks do not know the file
        raise ValueError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None
    drafter = _with_weights(cfg, Path(model_dir).expanduser(), dtype, fills)
    return Loaded(drafter.to(device), fmt, _notes(fmt, cfg, d, fills))


def _read_weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    tensors = {}
    for path in files:
        for name, t in load_file(str(path)).items():
            tensors[name.removeprefix("model.")] = t
    return tensors


def _filled(tensors: dict, cfg, fills: tuple[str, ...]) -> dict:
    """The heads a checkpoint lacks, as `_dspark_heads` says drafting reads them: zeros."""
    import torch

    h, r, v = cfg.hidden_size, cfg.markov_rank, cfg.vocab_size
    out = dict(tensors)
    if "markov" in fills:
        out["markov_head.markov_w1.weight"], out["markov_head.markov_w2.weight"] = torch.zeros(v, r), torch.zeros(v, r)
    if "confidence" in fills:
        out["confidence_head.proj.weight"], out["confidence_head.proj.bias"] = torch.zeros(1, h + r), torch.zeros(1)
    if "confidence_markov_input" in fills and "confidence_head.proj.weight" in out:
        w = out["confidence_head.proj.weight"]  # [1, H]: the hidden state alone
        out["confidence_head.proj.weight"] = torch.cat([w, w.new_zeros(1, r)], dim=-1)
    return out


def _with_weights(cfg, model_dir: Path, dtype, fills: tuple[str, ...] = ()):
    """Our drafter of `cfg` holding the directory's weights (the frozen target copies left out)."""
    import torch

    from dflash_train.model.drafter.heads.architectures import build_drafter

    tensors = _filled({k: v for k, v in _read_weights(model_dir).items() if k not in FROZEN_COPIES}, cfg, fills)
    with torch.device("meta"):
        drafter = build_drafter(cfg)
    wanted = drafter.state_dict()
    missing, unexpected = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match its config ({cfg.arch}, {cfg.num_layers} layers): "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, want in wanted.items():
        if tensors[name].shape != want.shape:
            raise ValueError(f"{model_dir}: {name} is {tuple(tensors[name].shape)}, its config makes it "
                             f"{tuple(want.shape)}")
    drafter.load_state_dict({k: tensors[k].to(dtype) if dtype else tensors[k] for k in wanted}, assign=True)
    return drafter


def _notes(fmt: str, cfg, d: dict, fills: tuple[str, ...]) -> tuple[str, ...]:
    notes = [{"markov": "no Markov head in the checkpoint: ours with a zero bias",
              "confidence": "no confidence head in the checkpoint (drafting reads none)",
              "confidence_markov_input": "its confidence head reads the hidden state alone: ours with zero weights "
                                         "on the Markov input"}[f] for f in fills]
    if fmt == "speculators" and SLIDING in cfg.layer_types:
        notes.append(f"speculators trains sliding layers with context back to anchor - {cfg.sliding_window}, we "
                     f"decode with each row's own window of {cfg.sliding_window}: the same while a text is shorter")
    if fmt == "deepspec":
        notes.append(f"DeepSpec's own anchors per sequence (num_anchors {d.get('num_anchors')}) are training-only")
    return tuple(notes)
