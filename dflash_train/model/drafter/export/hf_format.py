"""Drafter checkpoints in the z-lab format (spec 3.1) that vLLM and SGLang load, and the
speculators format (spec 3.2) as an export.

z-lab directory: `config.json` (a Qwen3Config plus DFlash keys) and `model.safetensors` holding
only `layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight` (no embedding, no lm_head: the
engines use the target's), except for a draft vocabulary in the engines' reduced form (`draft_vocab_size`,
the drafter's own `lm_head.weight` rows and `d2t`: model/drafter/export/draft_vocab.py). `block_size` is written
at the top level and inside `dflash_config`; both places are read, as are `target_layer_ids` at the top level
and a `model.` weight prefix. A target's embedding and logit scaling (`input_embedding_scale`,
`output_multiplier`, `final_logit_softcapping`, model/target/scaling.py) goes into `dflash_config` only where it
is not the identity.
Directories are written into a temporary sibling and renamed into place, so a reader never sees a
half-written checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_train.atomic import atomic_dir
from dflash_train.model.drafter.heads.architectures import HEADS, PLAIN, build_drafter, head, head_of_config
from dflash_train.model.drafter.attention import FULL, SLIDING
from dflash_train.model.drafter.config import DrafterConfig
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.drafter.export.draft_vocab import (DRAFT_VOCAB, SIZE_KEY, T2D, as_whole_vocabulary,
                                                           draft_vocab_file, served_config, served_tensors)
from dflash_train.model.target.scaling import FIELDS, Scaling
from dflash_train.model.target.taps import build_target_layer_ids

WEIGHTS = "model.safetensors"
TRAINED_AGAINST = "trained_against"
TRAINING_INPUT = "training_input"
"""dflash_config key recording how prompts were rendered in training (`conversations.chat_record`)."""
"""dflash_config key holding the identity of the target the drafter was trained against."""
ARCH_KEYS = {key for h in HEADS.values() for key in h.export.written()}
"""Every key a registered head writes (model/drafter/heads/architectures.py): its settings' keys and its constants."""
SCALING_KEYS = set(FIELDS)
"""dflash_config keys of the target's embedding and logit scaling (model/target/scaling.py), written only where
they are not the identity; read from dflash_config, else the top level, as z-lab's `dflash` reads them."""
DFLASH_KEYS = {"mask_token_id", "target_layer_ids", "block_size", "causal"} | ARCH_KEYS | SCALING_KEYS
KNOWN_KEYS = {
    "architectures", "model_type", "block_size", "num_target_layers", "dflash_config", "hidden_size",
    "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias", "attention_dropout",
    "max_position_embeddings", "layer_types", "use_sliding_window", "sliding_window", "max_window_layers",
    "tie_word_embeddings", "vocab_size", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "target_layer_ids", "auto_map", "transformers_version", "initializer_range", "use_cache", "is_causal",
    "mask_token_id", SIZE_KEY,
} | ARCH_KEYS | SCALING_KEYS


def zlab_config_dict(cfg: DrafterConfig, dtype: torch.dtype = torch.bfloat16,
                     trained_against: dict | None = None, training_input: dict | None = None,
                     draft_vocab: torch.Tensor | None = None) -> dict:
    """The config.json of a z-lab DFlash drafter (key order as in the published Qwen3-8B one), with
    `draft_vocab_size` where `draft_vocab` (token ids) is exported in the engines' reduced form.

    `trained_against` (the target's identity, `TargetInfo.provenance()`) goes into
    `dflash_config.trained_against`, a key the engines do not read; without it, one carried in
    `cfg.extra` from a loaded checkpoint stays.
    """
    export = head(cfg.arch).export
    d = {
        "architectures": list(export.architectures),
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                          "block_size": cfg.block_size, **_causal_keys(cfg, "causal"),
                          **({} if export.top_level else _arch_keys(cfg))},
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": list(cfg.layer_types),
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": cfg.num_layers,
        **_causal_keys(cfg, "is_causal"),
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        **served_config(draft_vocab),
        "dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }
    if export.top_level:
        d.update({**_arch_keys(cfg), "mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)})
    d["dflash_config"].update(cfg.scaling.non_identity())
    extra = dict(cfg.extra)
    d["dflash_config"].update(extra.pop("dflash_config", {}))
    if trained_against is not None:
        d["dflash_config"][TRAINED_AGAINST] = trained_against
    if training_input is not None:
        d["dflash_config"][TRAINING_INPUT] = training_input
    d.update(extra)
    return d


def _arch_keys(cfg: DrafterConfig) -> dict:
    """The head's own keys (its file's `HEAD.export`): its settings under their engine names, and constants."""
    export = head(cfg.arch).export
    return {**{key: getattr(cfg, name) for key, name in export.keys}, **dict(export.constants)}


def _arch_fields(d: dict, dflash: dict, arch: str, source: str) -> dict:
    """The head's settings from `dflash_config` (or the top level); a constant that says the checkpoint
    is another variant than this trainer's module is refused by name."""
    export = head(arch).export
    for key, want in export.constants:
        got = dflash.get(key, d.get(key))
        if got is not None and got != want:
            raise ValueError(f"{source}: {key}={got!r}, but this trainer's {arch} drafter is {key}={want!r}")
    return {name: dflash.get(key, d.get(key)) for key, name in export.keys if dflash.get(key, d.get(key)) is not None}


def read_head(d: dict, source: str = "config.json"):
    """(the head a config.json describes, its settings as written there: an instance of its settings
    dataclass, absent keys at their defaults; None for a head without settings)."""
    h = head_of_config(d, source, absent=PLAIN)
    fields = _arch_fields(d, d.get("dflash_config") or {}, h.name, source)
    return h, (h.settings(**fields) if h.settings else None)


def _causal_keys(cfg: DrafterConfig, key: str) -> dict:
    """`is_causal: false` (and `dflash_config.causal: false`) for a non-causal window: without it the
    engines make sliding-window layers causal inside the block (vLLM `_dflash_layer_causal`: explicit
    `is_causal` > `dflash_config.causal` > sliding layers causal); nothing for other drafters."""
    return {key: False} if SLIDING in cfg.layer_types and not cfg.window_causal else {}


def _window_causal(d: dict, dflash: dict, source: str) -> bool:
    """How the engines read a drafter's sliding layers: causal unless `is_causal` or
    `dflash_config.causal` says otherwise; a causal full-attention layer is not a DFlash drafter."""
    explicit = d.get("is_causal", dflash.get("causal"))
    if explicit and FULL in (d.get("layer_types") or (FULL,)):
        raise ValueError(f"{source}: is_causal/causal true makes full-attention layers causal, which no DFlash "
                         "drafter trains")
    return True if explicit is None else bool(explicit)


def drafter_config_from_zlab(d: dict, source: str = "config.json") -> DrafterConfig:
    """Read a z-lab config dict (ours or published); errors name the file and the key."""
    dflash = d.get("dflash_config") or {}
    try:
        block_size = dflash.get("block_size", d.get("block_size"))
        n_layers = d["num_hidden_layers"]
        n_target = d["num_target_layers"]
        ids = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        if ids is None:
            ids = build_target_layer_ids(n_target, n_layers)  # the old coupling: taps = layers
        if block_size is None:
            raise KeyError("block_size (top level or dflash_config.block_size)")
        mask_token_id = dflash.get("mask_token_id", d.get("mask_token_id"))
        if mask_token_id is None:
            raise KeyError("dflash_config.mask_token_id")
        heads = d["num_attention_heads"]
        arch = head_of_config(d, source, absent=PLAIN).name
        arch_fields = _arch_fields(d, dflash, arch, source)
        return DrafterConfig(
            arch=arch, **arch_fields,
            hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"], num_layers=n_layers,
            num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"],
            block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=tuple(ids),
            num_target_layers=n_target, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(d), max_position_embeddings=d.get("max_position_embeddings", 32768),
            layer_types=tuple(d.get("layer_types") or (FULL,) * n_layers), sliding_window=d.get("sliding_window"),
            window_causal=_window_causal(d, dflash, source),
            attention_bias=d.get("attention_bias", False), bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"), extra=_extra_keys(d), **_scaling_keys(d, dflash),
        )
    except KeyError as e:
        raise ValueError(f"{source}: missing key {e.args[0]}") from None


def _rope_theta(d: dict) -> float:
    """`rope_theta` at the top level, else in `rope_parameters` (where transformers 5 writes it alone), else 1e6."""
    params = d.get("rope_parameters")
    return d.get("rope_theta") or (params.get("rope_theta") if isinstance(params, dict) else None) or 1e6


def _scaling_keys(d: dict, dflash: dict) -> dict:
    defaults = Scaling().as_dict()
    return {k: dflash.get(k, d.get(k, defaults[k])) for k in FIELDS}


def _extra_keys(d: dict) -> dict:
    """Keys we do not model, carried through a load/save unchanged (unknown `dflash_config` keys,
    such as `trained_against`, under `dflash_config`)."""
    extra = {k: v for k, v in d.items() if k not in KNOWN_KEYS}
    dflash_extra = {k: v for k, v in (d.get("dflash_config") or {}).items() if k not in DFLASH_KEYS}
    if dflash_extra:
        extra["dflash_config"] = dflash_extra
    return extra


EXPORT_MARKER = "dflash_train_export.json"
"""Written last into every export (`export_drafter`, `save_speculators`): which program wrote the
directory, when, and each file's size and sha256. Only a directory carrying it is ever replaced by a
later export; anything else at `--out` is the user's and is refused (atomic.DestinationInUse)."""
EXPORT_WHAT = f"a drafter exported by dflash-train (no {EXPORT_MARKER} in it)"


def is_export(path: Path) -> bool:
    """A directory an earlier export of ours wrote (its EXPORT_MARKER names us)."""
    try:
        return json.loads((Path(path) / EXPORT_MARKER).read_text()).get("written_by") == "dflash-train"
    except (OSError, ValueError, AttributeError):
        return False


def write_export_marker(directory: Path) -> None:
    """The last file of an export: the files above with their sizes and sha256 (a later reader can tell
    a file changed since, and the next export knows the directory is ours to replace)."""
    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != EXPORT_MARKER}
    marker = {"written_by": "dflash-train", "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}
    _write_json(marker)(directory / EXPORT_MARKER)


def write_dir(out_dir: str | Path, files: dict) -> Path:
    """Write {name: callable(path)} into a temporary sibling renamed to out_dir when complete; an
    existing out_dir is replaced only if it is an earlier export of ours (`is_export`)."""
    with atomic_dir(out_dir, replaceable=is_export, what=EXPORT_WHAT) as tmp:
        for name, write in files.items():
            write(tmp / name)
    return Path(out_dir)


def _write_json(data: dict):
    def write(path: Path) -> None:
        path.write_text(json.dumps(data, indent=2) + "\n")

    return write


class NonFiniteWeights(ValueError):
    """A drafter's weights hold a NaN or an infinity: they are never written, exported or evaluated."""


def non_finite_weights(tensors: dict) -> list[str]:
    """Every floating tensor holding a NaN or an infinity, as 'name (n NaN, m inf of k)'."""
    out = []
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            out.append(f"{name} ({nan} NaN, {inf} inf of {tensor.numel()})")
    return out


def refuse_non_finite(tensors: dict, source: str, action: str) -> None:
    """Raise NonFiniteWeights naming every non-finite tensor of `source` and what was not done."""
    bad = non_finite_weights(tensors)
    if bad:
        raise NonFiniteWeights(f"{source}: the drafter's weights are not finite: {'; '.join(bad[:4])}"
                               f"{' ...' if len(bad) > 4 else ''}: {action}; a drafter with NaN or inf weights drafts "
                               "nothing useful: take an earlier checkpoint (its drafter/) or retrain")


def zlab_files(drafter: DFlashDrafter, dtype: torch.dtype, extra_files: dict | None, trained_against: dict | None,
                draft_vocab: torch.Tensor | None, training_input: dict | None,
                target_lm_head: torch.Tensor | None = None) -> dict:
    """{file name: writer(path)} of a z-lab directory (tensors cast to `dtype`). A draft vocabulary (token ids)
    is written in the engines' reduced form where the target's lm_head is given to copy its rows from (a head
    whose engines serve it: `Export.reduced_vocab.exported`), else kept as DRAFT_VOCAB."""
    served = draft_vocab if target_lm_head is not None else None
    if served is not None and not head(drafter.config.arch).export.reduced_vocab.exported:
        raise ValueError(f"a {drafter.config.arch} drafter's draft vocabulary is not exported in the reduced form: "
                         f"{head(drafter.config.arch).export.reduced_vocab.not_exported}")
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    if served is not None:
        tensors.update(served_tensors(served, target_lm_head, dtype))
    config = zlab_config_dict(drafter.config, dtype, trained_against, training_input, served)
    files = {"config.json": _write_json(config),
             WEIGHTS: lambda p: save_file(tensors, str(p), metadata={"format": "pt"})}
    if draft_vocab is not None and served is None:
        files[DRAFT_VOCAB] = _write_json(draft_vocab_file(draft_vocab))
    for name, data in (extra_files or {}).items():
        files[name] = _write_json(data)
    return files


def save_zlab(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
              extra_files: dict | None = None, trained_against: dict | None = None,
              draft_vocab: torch.Tensor | None = None, training_input: dict | None = None) -> Path:
    """Write config.json + model.safetensors (tensors cast to `dtype`), and DRAFT_VOCAB when
    `draft_vocab` ids are given, atomically (a checkpoint's drafter/; the checked serving artefact is
    `export_drafter`'s)."""
    return write_dir(out_dir, zlab_files(drafter, dtype, extra_files, trained_against, draft_vocab, training_input))


def load_zlab(model_dir: str | Path, device="cpu", dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load a z-lab drafter directory (ours or published) into a DFlashDrafter."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no config.json; is this a DFlash drafter directory?")
    cfg = drafter_config_from_zlab(json.loads(config_path.read_text()), str(config_path))
    tensors = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    for path in files:
        for name, t in load_file(str(path)).items():
            tensors[name.removeprefix("model.")] = t
    tensors = as_whole_vocabulary(tensors, cfg, str(model_dir))  # a draft vocabulary's own tensors left out
    with torch.device("meta"):
        drafter = build_drafter(cfg)
    missing = set(drafter.state_dict()) - set(tensors)
    unexpected = set(tensors) - set(drafter.state_dict()) - {"embed_tokens.weight"}
    if missing or unexpected:
        settings = ", ".join(f"{key}={getattr(cfg, name)!r}" for key, name in head(cfg.arch).export.keys)
        raise ValueError(f"{model_dir}: weights do not match the config ({cfg.arch} drafter{': ' if settings else ''}"
                         f"{settings}): missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    state = {k: tensors[k].to(dtype) if dtype else tensors[k] for k in drafter.state_dict()}
    drafter.load_state_dict(state, assign=True)
    return drafter.to(device)


def speculators_config_dict(cfg: DrafterConfig, verifier: str, verifier_arch: list[str],
                            draft_vocab_size: int | None = None) -> dict:
    """speculators `DFlashSpeculator` config (spec 3.2): aux ids = z-lab ids + 1. Its DFlash (1) config has no
    field for a target's embedding or logit scaling: a drafter of such a target is refused, naming it."""
    kind = head(cfg.arch).export.speculators_type
    if kind is None:
        raise ValueError(f"export.format=speculators: the speculators layout written here has no place for a "
                         f"{cfg.arch} drafter; export it in the z-lab format (export.format=zlab)")
    scaled = cfg.scaling.non_identity()
    if scaled:
        raise ValueError(f"export.format=speculators: the DFlashSpeculator config has no field for "
                         f"{', '.join(f'dflash_config.{k}={v}' for k, v in scaled.items())} (the target's scaling); "
                         "export in the z-lab format (export.format=zlab)")
    layer_cfg = {k: v for k, v in zlab_config_dict(cfg).items()
                 if k not in ("architectures", "block_size", "num_target_layers", "dflash_config")}
    return {
        "speculators_model_type": kind,
        "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": draft_vocab_size or cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": SLIDING in cfg.layer_types and not cfg.window_causal,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_arch},
        },
        "speculators_version": "0.9.0",
    }


def save_speculators(drafter: DFlashDrafter, out_dir: str | Path, embed_weight: torch.Tensor,
                     lm_head_weight: torch.Tensor, verifier: str, verifier_arch: list[str],
                     dtype: torch.dtype = torch.bfloat16, draft_vocab: torch.Tensor | None = None) -> Path:
    """speculators layout: the drafter weights plus frozen copies of embed_tokens and lm_head (non-finite
    weights refused before anything is written; an existing out_dir replaced only if it is ours). A draft
    vocabulary (token ids) of a head the engines serve reduced is written as speculators writes one: lm_head
    rows at those tokens, `d2t` and the `t2d` mask (which vLLM skips), `draft_vocab_size`."""
    cfg = drafter.config
    reduced = draft_vocab if draft_vocab is not None and head(cfg.arch).export.reduced_vocab.exported else None
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    refuse_non_finite(tensors, str(out_dir), "nothing was written")
    tensors["embed_tokens.weight"] = embed_weight.detach().to("cpu", dtype).contiguous()
    tensors["lm_head.weight"] = lm_head_weight.detach().to("cpu", dtype).clone().contiguous()
    if reduced is not None:
        tensors.update(served_tensors(reduced, lm_head_weight, dtype))
        tensors[T2D] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, reduced.cpu().long(), True)
    config = speculators_config_dict(cfg, verifier, verifier_arch, None if reduced is None else reduced.numel())
    files = {"config.json": _write_json(config),
             WEIGHTS: lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
             EXPORT_MARKER: lambda p: write_export_marker(p.parent)}  # last: it lists the files above
    return write_dir(out_dir, files)
