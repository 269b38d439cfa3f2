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
  `lm_head` is saved only with a reduced draft vocabulary (`draft_vocab_size` below the verifier's, with `d2t`
  and `t2d`: read for the heads vLLM serves reduced, as model/drafter/export/draft_vocab.py reads ours; the eval
  drafts over it as vLLM does).
- DeepSeek DeepSpec (`Qwen3DSparkModel` without `dflash_config`; deepspec/modeling/dspark/qwen3): the
  target's own config copied, with `block_size`, `target_layer_ids` (z-lab ids; -1 is the embedding
  output), `mask_token_id`, `num_target_layers`, `num_anchors`, `markov_rank`, `markov_head_type`,
  `enable_confidence_head`, `confidence_head_with_markov` at the top level, RoPE in `rope_parameters`,
  every layer full attention; the frozen `embed_tokens` and `lm_head` copies are saved too (unused: the
  target's own are). Its DFlash is this DSpark with `markov_rank` 0 and no confidence head.
What is particular to a head (which speculators type it is, its config classes' defaults, the parts a
checkpoint may lack and what drafting reads there: a DSpark without a Markov or confidence head reads as
ours with zeros, said in a note) is declared in its file as `Head.foreign` (model/drafter/head.py `Foreign`);
this module knows the formats only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from dflash_train.model.drafter.attention import FULL, SLIDING
from dflash_train.model.drafter.export.draft_vocab import as_whole_vocabulary, read_served
from dflash_train.model.drafter.head import Head
from dflash_train.model.drafter.heads.architectures import HEADS, build_drafter, head

FORMATS = ("zlab", "speculators", "deepspec")
SPECULATORS_HEADS = {h.foreign.speculators_type: h for h in HEADS.values() if h.foreign and h.foreign.speculators_type}
"""speculators_model_type -> our head of the same drafter."""
DEEPSPEC_HEADS = tuple(h for h in HEADS.values() if h.foreign and h.foreign.deepspec)
"""The heads DeepSeek's DeepSpec writes, each under its export's `architectures`."""
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
    if _deepspec_head(d) is not None and "dflash_config" not in d:
        return "deepspec"
    return "zlab"


def _deepspec_head(d: dict) -> Head | None:
    names = set(d.get("architectures") or [])
    return next((h for h in DEEPSPEC_HEADS if names & set(h.export.architectures)), None)


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


def _check_speculators(d: dict, source: str) -> Head:
    kind = d["speculators_model_type"]
    if kind not in SPECULATORS_HEADS:
        raise UnsupportedDrafter(source, "speculators_model_type", f"{kind!r} is not a drafter of the DFlash family "
                                 f"this trainer reads ({', '.join(SPECULATORS_HEADS)})")
    h = SPECULATORS_HEADS[kind]
    _require(d, ("transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id", "block_size",
                 "draft_vocab_size"), source)
    if min(d["aux_hidden_state_layer_ids"]) < 1:
        raise UnsupportedDrafter(source, "aux_hidden_state_layer_ids", f"{d['aux_hidden_state_layer_ids']} taps the "
                                 "embedding output (0), which no DFlash drafter of this trainer reads")
    ours = h.foreign.from_anchor
    from_anchor = d.get("sample_from_anchor", ours)  # the config class's default
    if from_anchor != ours:
        raise UnsupportedDrafter(source, "sample_from_anchor", f"{from_anchor} on a {kind} drafter: this trainer's "
                                 f"{h.name} drafts from the anchor's slot {'only' if ours else 'never'}")
    return h


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


def _head_keys(h: Head, d: dict) -> tuple[dict, tuple[str, ...]]:
    """The head's keys as our export writes them, and the parts the checkpoint lacks (`Foreign.heads`)."""
    if h.foreign.heads is not None:
        return h.foreign.heads(d)
    return {key: d[key] for key, _ in h.export.keys if key in d}, ()


def _place_keys(h: Head, zlab: dict, keys: dict) -> None:
    """Where our export writes the head's keys: the top level or `dflash_config` (model/drafter/head.py Export)."""
    (zlab if h.export.top_level else zlab["dflash_config"]).update(keys)


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
    h = _check_speculators(d, source)
    if num_target_layers is None:
        raise UnsupportedDrafter(source, "speculators_config.verifier", "the format records no verifier layer "
                                 "count: load the drafter with its target")
    layer = _layer_config(d, source)
    reduced = h.export.reduced_vocab
    if d["draft_vocab_size"] != layer.vocab_size and not reduced.served_by:
        raise UnsupportedDrafter(source, "draft_vocab_size", f"{d['draft_vocab_size']} of the verifier's "
                                 f"{layer.vocab_size} tokens: a reduced draft vocabulary of a {h.name} drafter, which "
                                 f"no engine serves as trained ({reduced.not_exported}): not measured")
    if d.get("target_hidden_size") not in (None, layer.hidden_size):
        raise UnsupportedDrafter(source, "target_hidden_size", f"{d['target_hidden_size']} differs from the drafter's "
                                 f"{layer.hidden_size}: our drafters run at the target's width")
    _check_act(getattr(layer, "hidden_act", None), source, "transformer_layer_config.hidden_act")
    n = layer.num_hidden_layers
    types = list(getattr(layer, "layer_types", None) or [FULL] * n)
    ids = [i - 1 for i in d["aux_hidden_state_layer_ids"]]  # HF hidden_states index -> z-lab decoder layer id
    zlab = {
        "architectures": [h.export.architectures[0]], "model_type": "qwen3", "block_size": d["block_size"],
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
    if SLIDING in types and d.get("sliding_window_non_causal", h.foreign.window_non_causal):  # the class's default
        zlab["is_causal"] = False
    keys, missing = _head_keys(h, d)
    _place_keys(h, zlab, keys)
    return zlab, missing


def _from_deepspec(d: dict, source: str, num_target_layers: int | None) -> dict:
    _check_deepspec(d, source)
    _check_act(d.get("hidden_act"), source, "hidden_act")
    h = _deepspec_head(d)
    zlab = {k: v for k, v in d.items() if k not in ("rope_parameters", "rope_scaling", *h.export.written())}
    zlab["rope_theta"] = _rope_theta(d, source)
    zlab.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    keys, missing = _head_keys(h, {**dict(h.foreign.deepspec_defaults), **d})
    _place_keys(h, zlab, keys)
    return zlab, missing  # DeepSpec's slot k drafts anchor + k + 1 (its label offsets 1..B)


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
    read_served(Path(model_dir).expanduser(), cfg.vocab_size, rows=False)  # a reduced vocabulary readable, or named
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


def _filled(tensors: dict, cfg, missing: tuple[str, ...]) -> dict:
    """The parts a checkpoint lacks, as its head says drafting reads them (`Foreign.fill`)."""
    return head(cfg.arch).foreign.fill(tensors, cfg, missing) if missing else tensors


def _with_weights(cfg, model_dir: Path, dtype, fills: tuple[str, ...] = ()):
    """Our drafter of `cfg` holding the directory's weights (the frozen target copies left out)."""
    import torch

    tensors = {k: v for k, v in _read_weights(model_dir).items() if k not in FROZEN_COPIES}
    tensors = _filled(as_whole_vocabulary(tensors, cfg, str(model_dir)), cfg, fills)
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
    said = dict(head(cfg.arch).foreign.notes) if fills else {}
    notes = [said[part] for part in fills]
    if fmt == "speculators" and SLIDING in cfg.layer_types:
        notes.append(f"speculators trains sliding layers with context back to anchor - {cfg.sliding_window}, we "
                     f"decode with each row's own window of {cfg.sliding_window}: the same while a text is shorter")
    if fmt == "deepspec":
        notes.append(f"DeepSpec's own anchors per sequence (num_anchors {d.get('num_anchors')}) are training-only")
    return tuple(notes)
