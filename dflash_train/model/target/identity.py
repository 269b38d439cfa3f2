"""Which target a drafter was trained against, read from the files only (no model load).

A drafter is only as good as the match between the taps it was trained on and the taps the engine
gives it, so an export records its training target (`TargetInfo.provenance()`, stored as
`dflash_config.trained_against`) and `dflash-train check --target T` compares T against it:
- `config_sha256`: the target's config.json without the keys that change with how it was saved
  or loaded (dtype, transformers version, path);
- `weights_sha256`: the sha256 of every safetensors file's whole content (hashed once per file
  version and node, `cache.file_sha256`): any changed weight changes it, and it survives a copy;
- `weights_fingerprint`: per safetensors file its name, size, header and 16 evenly spaced 4 KiB
  samples of the data: cheap, and what exports recorded before `weights_sha256` (a weight nudged
  between two samples keeps it: only `weights_sha256` identifies the weights);
- `quantization`: `gguf Q4_1` when the trainer dequantised a GGUF file; what engines must then
  serve is the HF directory this tool converted it into (`serve`), not the hub's bf16 model.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_train import cache
from dflash_train.model.target import load as target_mod

VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype"}
SAMPLES_PER_FILE, SAMPLE_BYTES = 16, 4096
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class TargetInfo:
    name: str
    """The target as given to the trainer (`smollm2`, a path, a hub id, a .gguf file)."""
    path: str
    """The HF directory the weights were loaded from (for a GGUF: its dequantised conversion)."""
    quantization: str | None
    """`gguf Q4_1` for a dequantised GGUF, else None."""
    config_sha256: str
    weights_fingerprint: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    """Rows of the input embedding (as `Target.vocab_size`)."""
    serve: str
    """What a serving engine should load as the target to see the training taps and lm_head: the
    GGUF's converted directory, the local directory, or the hub id."""
    weights_sha256: str = ""
    """The whole weights' content (`weights_sha256`); empty where it was not computed."""

    def provenance(self) -> dict:
        return asdict(self)


def describe_target(model: str, gguf_file: str | None = None, log=print) -> TargetInfo:
    """Identify a target spec (as `load_target` takes it) from its files; converts a GGUF once
    (as `load_target` would) since the conversion is what the trainer loads."""
    path, gguf = target_mod.resolve_target(model, gguf_file)
    quantization = None
    if gguf is not None:
        gguf_path = Path(path) / gguf
        quantization = f"gguf {gguf_file_type(gguf_path)}"
        hf_dir = target_mod.converted_gguf_dir(path, gguf)  # load_target's one conversion, made once per cache
    else:
        hf_dir = _local_model_dir(model)
    serve = model if gguf is None and not Path(model).expanduser().is_dir() else str(hf_dir)  # a hub id: portable
    config = json.loads((hf_dir / "config.json").read_text())
    text = config.get("text_config") or config
    weights = sorted(hf_dir.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"target {model!r}: no *.safetensors in {hf_dir}")
    return TargetInfo(name=model, path=str(hf_dir), quantization=quantization, config_sha256=config_hash(config),
                      weights_fingerprint=weights_fingerprint(weights), num_layers=int(text["num_hidden_layers"]),
                      hidden_size=int(text["hidden_size"]),
                      vocab_size=_embedding_rows(weights) or int(text["vocab_size"]), serve=serve,
                      weights_sha256=weights_sha256(weights, log))


def _local_model_dir(model: str) -> Path:
    """A local HF directory, or the cached snapshot of a hub id (never downloaded)."""
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser()
    from huggingface_hub import snapshot_download  # only for hub ids; a transformers dependency
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as e:
        raise FileNotFoundError(f"target {model!r}: not a local directory and not in the Hugging Face cache "
                                f"(dflash-train never downloads): {e}") from None


def config_hash(config: dict) -> str:
    stable = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the header alone (no tensor is read)."""
    header = json.loads(_safetensors_header(path))
    return {name: tuple(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}


def weights_fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        header = _safetensors_header(path)
        digest.update(f"{path.name}|{size}|".encode() + header)
        start = 8 + len(header)
        span = max(size - start - SAMPLE_BYTES, 0)
        with open(path, "rb") as f:
            for i in range(SAMPLES_PER_FILE):
                f.seek(start + span * i // (SAMPLES_PER_FILE - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def weights_sha256(files: list[Path], log=print) -> str:
    """One digest of the files' names and whole contents (each hashed once per version: cached)."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}|{cache.file_sha256(path, log)};".encode())
    return digest.hexdigest()[:16]


def _embedding_rows(files: list[Path]) -> int | None:
    for path in files:
        for name, shape in safetensors_shapes(path).items():
            if name.endswith("embed_tokens.weight"):
                return int(shape[0])
    return None


def gguf_file_type(path: Path) -> str:
    """`Q4_1` etc. from the GGUF header's `general.file_type` (read up to that key only: the
    gguf package's reader maps every tensor first, 30 s on a loaded machine)."""
    import gguf  # the GGUF constants; a dependency for GGUF targets only

    with open(path, "rb") as f:
        magic, _version, _tensors, n_keys = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        for _ in range(n_keys):
            key = _read_gguf_value(f, _GGUF_STRING)
            (value_type,) = struct.unpack("<I", f.read(4))
            value = _read_gguf_value(f, value_type)
            if key == "general.file_type":
                return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
    return "unknown"


def _read_gguf_value(f, value_type: int):
    if value_type in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[value_type]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if value_type == _GGUF_STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode("utf-8", "replace")
    if value_type == _GGUF_ARRAY:
        element_type, n = struct.unpack("<IQ", f.read(12))
        for _ in range(n):
            _read_gguf_value(f, element_type)  # skipped: only scalars are looked up
        return None
    raise ValueError(f"GGUF metadata value type {value_type} unknown")


def serve_note(trained_against: dict | None) -> str:
    """What to serve as the target, and why, for a drafter's recorded training target."""
    if not trained_against:
        return "the training target is not recorded in this drafter: serve the exact model it was trained against"
    quant = trained_against.get("quantization")
    if quant and quant.startswith("gguf"):
        return (f"trained against {trained_against['name']} ({quant}, dequantised): serve its converted HF "
                f"directory {trained_against['serve']}, whose weights are exactly the ones trained against; "
                "a hub bf16 model or the quantised GGUF gives other taps and another lm_head")
    return f"trained against {trained_against['name']}: serve that same model"
