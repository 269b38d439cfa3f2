"""A target that holds only some of its weights: what a drafter rank of a disaggregated run reads.

A drafter rank never runs the target's forward (target ranks send it the taps); it reads the
config, the tokenizer, the input embedding (block inputs), the lm_head (the loss) and, when the
drafter starts from the target (`drafter.init_from_target`), the final norm and the last decoder
layers it copies. So the model is built on the meta device (no storage) and only those tensors are
read from the safetensors files, by name, without reading the rest: a target larger than one
device costs a drafter rank its embedding and lm_head only.

Parameters are found by identity, so tied embeddings (lm_head is the embedding's Parameter) stay
one tensor, read from whichever of the tied names the checkpoint stores. Everything else stays on
the meta device; a forward through such a model is an error (it would compute nothing real).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class TargetSubset:
    """Which weights a process that never runs the target holds, beside embedding and lm_head."""

    last_layers: int = 0  # decoder layers counted from the end (the drafter's init copies them)
    final_norm: bool = False  # the drafter's init copies its scale


def checkpoint_dir(path: str, **hub_kwargs) -> Path:
    """The directory that holds the target's config and safetensors: `path` itself, or the
    snapshot of a hub id already in the Hugging Face cache (never downloaded)."""
    if Path(path).is_dir():
        return Path(path)
    from transformers.utils import cached_file  # a heavy import, needed only for hub ids

    return Path(cached_file(path, "config.json", **hub_kwargs)).parent


def tensor_files(directory: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file that holds it (sharded index or one file)."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"target {directory}: neither {INDEX_FILE} nor {SINGLE_FILE} is there")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def load_subset(config, directory: Path, subset: TargetSubset, dtype: torch.dtype, device: torch.device,
                trust_remote_code: bool = False) -> nn.Module:
    """The HF causal LM of `config` on the meta device, with only embedding, lm_head and `subset`
    read from `directory`'s safetensors onto `device` (floating tensors in `dtype`)."""
    from transformers import AutoModelForCausalLM  # heavy; the caller (load_target) imports it too

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    files = tensor_files(directory)
    required, optional = _wanted(model, subset)
    for param_id, aliases in _tied_groups(model, required | optional).items():
        key = _checkpoint_key(aliases, files, model.base_model_prefix)
        if key is None:
            if param_id in required:
                source = directory / INDEX_FILE if (directory / INDEX_FILE).is_file() else directory / SINGLE_FILE
                raise KeyError(f"target {directory}: no tensor named {' or '.join(sorted(aliases))} in {source}")
            continue  # e.g. fused MoE experts stored per expert: the drafter copies no such weight
        _assign(model, aliases, _read(files[key], key, dtype, device))
    model.eval().requires_grad_(False)
    _forbid_forward(model)
    return model


def read_lm_head(directory: str | Path, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.Tensor:
    """The target's lm_head weight [V, H] on the CPU in `dtype` (its input embedding where the two are tied),
    read by name from its safetensors without the rest of the model: what an export copies its draft
    vocabulary's rows from (model/drafter/export/draft_vocab.py)."""
    from transformers import AutoConfig  # heavy; only when an export writes a draft vocabulary

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=trust_remote_code)
    model = load_subset(config, Path(directory), TargetSubset(), dtype, torch.device("cpu"), trust_remote_code)
    return model.get_output_embeddings().weight.detach()


def _wanted(model: nn.Module, subset: TargetSubset) -> tuple[set[int], set[int]]:
    """Ids of the Parameters to read: required (embedding, lm_head, final norm) and optional
    (the last decoder layers: a layer tensor the checkpoint names differently is not copied)."""
    required = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    decoder = model.get_decoder()
    if subset.final_norm:
        required |= {id(p) for p in decoder.norm.parameters()}
    optional = set()
    if subset.last_layers > 0:
        for layer in list(decoder.layers)[-subset.last_layers:]:
            optional |= {id(p) for p in layer.parameters()}
    return required, optional - required


def _tied_groups(model: nn.Module, wanted: set[int]) -> dict[int, set[str]]:
    """Each wanted Parameter's id -> every name it goes by (tied weights share one Parameter)."""
    names: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in wanted:
            names.setdefault(id(param), set()).add(name)
    return names


def _checkpoint_key(aliases: set[str], files: dict[str, Path], prefix: str) -> str | None:
    """The checkpoint's name of a parameter: one of its aliases as is, or without / with the base
    model prefix (checkpoints of a bare base model store `layers.0...`, not `model.layers.0...`)."""
    for name in sorted(aliases):
        stripped = name[len(prefix) + 1:] if name.startswith(prefix + ".") else None
        for key in (name, stripped, f"{prefix}.{name}"):
            if key in files:
                return key
    return None


def _read(file: Path, key: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with safe_open(file, "pt", device="cpu") as f:  # reads this one tensor, not the file
        tensor = f.get_tensor(key)
    return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)


def _assign(model: nn.Module, aliases: set[str], tensor: torch.Tensor) -> None:
    """One new Parameter set under every alias, so tied weights stay one tensor."""
    param = nn.Parameter(tensor, requires_grad=False)
    for name in aliases:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, param)


def _forbid_forward(model: nn.Module) -> None:
    """A forward on meta weights returns meta tensors, not an error: make it one."""
    def refuse(module, args):
        raise RuntimeError("this target holds only its embedding, lm_head and the weights a drafter copies "
                           "(a drafter rank of a disaggregated run): it cannot run the target's forward")

    model.register_forward_pre_hook(refuse)
    model.get_decoder().register_forward_pre_hook(refuse)


def held_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters with real storage (all of them for a whole target)."""
    return [name for name, param in model.named_parameters(remove_duplicate=False) if not param.is_meta]
