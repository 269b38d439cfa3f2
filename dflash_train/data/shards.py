"""Offline hidden-state shards (`dflash-train prepare`) and their reader.

Shard `shard-NNNNN.safetensors` holds, for the samples it covers, concatenated along tokens:
- `input_ids` int32 (T,), `loss_mask` uint8 (T,), `offsets` int64 (n+1,) (sample i is rows
  offsets[i]:offsets[i+1]);
- `taps` (T, K*H): bf16, or fp8 e4m3 (`torch.float8_e4m3fn`) with `taps_scale` fp32 (T,), one
  scale per token row: taps ~= taps_fp8.float() * taps_scale[:, None]. After scaling by
  amax/448 every element is within max(2^-4 |x|, 2^-10 * scale) of the original (3 mantissa bits
  give relative error <= 2^-4 in the normal range; below 2^-6 the subnormal spacing 2^-9 rules).
`index.json` lists complete shards only (sample and token counts, sha256), with the dtype,
layer_ids, target name and hidden size. Every shard and every index update is written to a temp
file, fsync'd and renamed, so a killed prepare resumes after the last complete shard.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from dflash_train import atomic, cache
from dflash_train.data.conversations import TokenizedSample

SCHEMA_VERSION = 1
INDEX_NAME = "index.json"
LOCK_NAME = ".prepare.lock"  # held by the one prepare writing the directory
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FORMATS = ("bf16", "fp8")


# ---------------------------------------------------------------------------------------------
# Encoding


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (token) scaled fp8 e4m3: (T, D) -> (fp8 (T, D), fp32 scale (T,))."""
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # (T,)
    return (x / scale[:, None]).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)  # (T, D)


def bytes_per_token(tap_width: int, fmt: str) -> int:
    """Stored bytes per token: ids (4) + mask (1) + taps (2*D for bf16, D + 4 scale for fp8)."""
    return 5 + (2 * tap_width if fmt == "bf16" else tap_width + 4)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_index(out_dir: Path, index: dict) -> None:
    atomic.write_text(out_dir / INDEX_NAME, json.dumps(index, indent=1))
    atomic.fsync_dir(out_dir)  # make the rename itself durable


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], sample_ids: list[str]) -> str:
    """Write via temp file + fsync + rename; return the file's sha256."""
    atomic.write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata={"sample_ids": json.dumps(sample_ids)}))
    return _sha256(path)


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class _ShardBuffer:
    """Samples and taps accumulated for the next shard (taps already in storage dtype)."""

    fmt: str

    def __post_init__(self):
        self.ids, self.masks, self.taps, self.scales, self.sample_ids = [], [], [], [], []

    @property
    def tokens(self) -> int:
        return sum(len(m) for m in self.masks)

    def add(self, sample: TokenizedSample, taps: torch.Tensor) -> None:
        self.ids.append(torch.tensor(sample.input_ids, dtype=torch.int32))
        self.masks.append(torch.tensor(sample.loss_mask, dtype=torch.uint8))
        self.sample_ids.append(sample.id)
        if self.fmt == "fp8":
            q, scale = quantize_fp8(taps)
            self.taps.append(q.cpu())
            self.scales.append(scale.cpu())
        else:
            self.taps.append(taps.to(torch.bfloat16).cpu())

    def tensors(self) -> dict[str, torch.Tensor]:
        lengths = torch.tensor([0] + [len(m) for m in self.masks], dtype=torch.int64)
        out = {"input_ids": torch.cat(self.ids), "loss_mask": torch.cat(self.masks),
               "offsets": lengths.cumsum(0), "taps": torch.cat(self.taps)}
        if self.fmt == "fp8":
            out["taps_scale"] = torch.cat(self.scales)
        return out


def samples_fingerprint(samples: list[TokenizedSample]) -> str:
    """Identifies the sample list (ids, lengths, supervised counts), so a resume on other data fails."""
    h = hashlib.sha256()
    for s in samples:
        h.update(f"{s.id}\t{len(s.input_ids)}\t{sum(s.loss_mask)}\n".encode())
    return h.hexdigest()


def _open_index(out_dir: Path, meta: dict) -> dict:
    """Load the index of a previous run with the same settings, or start a new one."""
    path = out_dir / INDEX_NAME
    if not path.exists():
        return {**meta, "shards": [], "complete": False}
    index = json.loads(path.read_text())
    changed = [k for k in meta if index.get(k) != meta[k]]
    if changed:
        raise ValueError(f"{path} was written with other settings ({', '.join(changed)} differ); "
                         "use a new --out directory or delete this one")
    return index


def _remove_leftovers(out_dir: Path, index: dict) -> None:
    """Temp files of a killed write, and shards renamed but never indexed, are discarded."""
    listed = {s["file"] for s in index["shards"]}
    for p in out_dir.iterdir():
        if ".tmp" in p.name or (p.name.startswith("shard-") and p.name not in listed):
            print(f"prepare: removing leftover {p.name} from an interrupted run", flush=True)
            p.unlink()


def check_disk_space(out_dir: Path, needed_bytes: int) -> None:
    free = shutil.disk_usage(out_dir).free
    if needed_bytes > free:
        raise OSError(f"not enough disk space in {out_dir}: shards need ~{needed_bytes / 2**30:.2f} GiB, "
                      f"{free / 2**30:.2f} GiB free; use fp8 (about half), fewer samples, or another --out")


def _batches(samples: list[TokenizedSample], batch_tokens: int):
    """Consecutive samples whose padded size (rows x longest) stays within `batch_tokens`."""
    batch, longest = [], 0
    for s in samples:
        if batch and (len(batch) + 1) * max(longest, len(s.input_ids)) > batch_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(s)
        longest = max(longest, len(s.input_ids))
    if batch:
        yield batch


def _batch_taps(target, batch: list[TokenizedSample], layer_ids) -> list[torch.Tensor]:
    """Taps of each sample (its own length) from one right-padded forward."""
    width = max(len(s.input_ids) for s in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
        mask[i, : len(s.input_ids)] = 1
    taps = target.taps(ids, mask, layer_ids)  # (b, W, K*H)
    return [taps[i, : len(s.input_ids)] for i, s in enumerate(batch)]


@dataclass
class PrepareReport:
    shards: int
    samples: int
    tokens: int
    bytes: int
    resumed_after: int
    """Samples already in complete shards when this run started."""


def prepare_shards(target, samples: list[TokenizedSample], out_dir: str | Path, layer_ids, fmt: str = "bf16",
                   shard_tokens: int = 65536, batch_tokens: int = 16384, target_name: str | None = None,
                   on_shard: Callable[[int], None] | None = None) -> PrepareReport:
    """Write `samples` with their taps as shards under `out_dir`; resumes a killed run (module doc).

    `on_shard(shard_number)` runs after each shard and its index entry are durably written.
    A second prepare into a directory still being written is refused (`cache.CacheBusy`), never
    interleaved: it holds the lock `out_dir/.prepare.lock` (released when its process dies).
    """
    if fmt not in FORMATS:
        raise ValueError(f"shard format {fmt!r}: expected one of {FORMATS}")
    out_dir = Path(out_dir)
    with cache.exclusive(out_dir / LOCK_NAME, f"the shard directory {out_dir}", wait=False):
        return _prepare_locked(target, samples, out_dir, layer_ids, fmt, shard_tokens, batch_tokens, target_name,
                               on_shard)


def _prepare_locked(target, samples: list[TokenizedSample], out_dir: Path, layer_ids, fmt: str, shard_tokens: int,
                    batch_tokens: int, target_name: str | None, on_shard) -> PrepareReport:
    layer_ids = [int(i) for i in layer_ids]
    tap_width = len(layer_ids) * target.hidden_size
    meta = {"schema": SCHEMA_VERSION, "target": target_name or target.name, "layer_ids": layer_ids,
            "hidden_size": target.hidden_size, "tap_width": tap_width, "dtype": fmt,
            "samples_fingerprint": samples_fingerprint(samples), "total_samples": len(samples)}
    index = _open_index(out_dir, meta)
    _remove_leftovers(out_dir, index)
    done = sum(s["samples"] for s in index["shards"])
    remaining = samples[done:]
    bpt = bytes_per_token(tap_width, fmt)
    todo_tokens = sum(len(s.input_ids) for s in remaining)
    print(f"prepare: storage estimate {bpt} bytes/token x {todo_tokens} tokens = {bpt * todo_tokens / 2**20:.1f} MiB "
          f"({fmt}, taps {layer_ids} x hidden {target.hidden_size}); {done} samples already done", flush=True)
    check_disk_space(out_dir, int(bpt * todo_tokens * 1.02) + (1 << 20))
    buffer = _ShardBuffer(fmt)
    bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc="prepare", dynamic_ncols=True)
    for batch in _batches(remaining, batch_tokens):
        for sample, taps in zip(batch, _batch_taps(target, batch, layer_ids)):
            buffer.add(sample, taps)
            if buffer.tokens >= shard_tokens:
                _flush(out_dir, index, buffer, on_shard)
                buffer = _ShardBuffer(fmt)
        bar.update(sum(len(s.input_ids) for s in batch))
    if buffer.sample_ids:
        _flush(out_dir, index, buffer, on_shard)
    bar.close()
    index["complete"] = True
    _write_index(out_dir, index)
    shards = index["shards"]
    return PrepareReport(len(shards), sum(s["samples"] for s in shards), sum(s["tokens"] for s in shards),
                         sum((out_dir / s["file"]).stat().st_size for s in shards), done)


def _flush(out_dir: Path, index: dict, buffer: _ShardBuffer, on_shard) -> None:
    number = len(index["shards"])
    name = f"shard-{number:05d}.safetensors"
    digest = _write_shard(out_dir / name, buffer.tensors(), buffer.sample_ids)
    index["shards"].append({"file": name, "samples": len(buffer.sample_ids), "tokens": buffer.tokens,
                            "sha256": digest})
    _write_index(out_dir, index)  # only now does the shard count as written
    if on_shard is not None:
        on_shard(number)


# ---------------------------------------------------------------------------------------------
# Reading


class ShardReader:
    """Samples `{"id", "input_ids" int64 (n,), "loss_mask" uint8 (n,), "taps" (n, K*H) in `dtype`}`
    from the complete shards of `index.json`.

    Order: a permutation of all samples seeded by (seed, epoch), truncated to a multiple of `world`
    so every rank yields the same count, of which rank r takes positions r, r+world, ...
    Iterating continues from the current (epoch, position) to the end of that epoch, then moves to
    the next epoch; `state_dict()` taken between samples resumes exactly. A shard's sha256 is
    checked before its first sample is returned (`verify="lazy"`), for all shards at construction
    (`"open"`), or never (`"none"`).
    """

    def __init__(self, directory: str | Path, seed: int = 0, rank: int = 0, world: int = 1,
                 dtype: torch.dtype = torch.bfloat16, verify: str = "lazy"):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world size {world}")
        if verify not in ("lazy", "open", "none"):
            raise ValueError(f"verify {verify!r}: expected lazy, open or none")
        self.directory, self.seed, self.rank, self.world, self.dtype = Path(directory), seed, rank, world, dtype
        self.index = json.loads((self.directory / INDEX_NAME).read_text())
        if not self.index.get("complete"):
            print(f"shards: {self.directory} is incomplete (prepare was interrupted); reading its "
                  f"{len(self.index['shards'])} complete shards", flush=True)
        self._verified = set() if verify != "none" else set(range(len(self.index["shards"])))
        if verify == "open":
            for i in range(len(self.index["shards"])):
                self._verify(i)
        self._handles: dict[int, object] = {}
        self._ids: dict[int, list[str]] = {}
        self._samples = self._sample_table()  # (shard, row start, row end, position in shard)
        self.epoch, self.position = 0, 0

    @property
    def layer_ids(self) -> list[int]:
        return list(self.index["layer_ids"])

    def _sample_table(self) -> list[tuple[int, int, int, int]]:
        table = []
        for i, entry in enumerate(self.index["shards"]):
            offsets = self._handle(i).get_tensor("offsets").tolist()
            if len(offsets) != entry["samples"] + 1:
                raise ValueError(f"shard {entry['file']}: {len(offsets) - 1} samples, index says {entry['samples']}")
            table.extend((i, offsets[j], offsets[j + 1], j) for j in range(entry["samples"]))
        return table

    def _handle(self, shard: int):
        if shard not in self._handles:
            path = self.directory / self.index["shards"][shard]["file"]
            self._handles[shard] = safe_open(str(path), framework="pt")
        return self._handles[shard]

    def _verify(self, shard: int) -> None:
        entry = self.index["shards"][shard]
        actual = _sha256(self.directory / entry["file"])
        if actual != entry["sha256"]:
            raise ValueError(f"shard {entry['file']} in {self.directory}: sha256 mismatch (index "
                             f"{entry['sha256'][:12]}..., file {actual[:12]}...): corrupt or rewritten; re-run prepare")
        self._verified.add(shard)

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self._samples), generator=g).tolist()
        usable = len(perm) - len(perm) % self.world
        return perm[:usable][self.rank::self.world]

    def __len__(self) -> int:
        """Samples this rank yields per epoch."""
        return len(self._samples) // self.world

    def _sample_ids(self, shard: int) -> list[str]:
        if shard not in self._ids:
            self._ids[shard] = json.loads(self._handle(shard).metadata()["sample_ids"])
        return self._ids[shard]

    def tokens(self, i: int) -> dict:
        """`{"id", "input_ids", "loss_mask"}` of sample i without its taps: what a trainer needs to
        plan batches, read without touching the taps (shards are mostly taps) or hashing the shard.
        The checksum is still checked before the shard's first taps are read."""
        shard, a, b, j = self._samples[i]
        f = self._handle(shard)
        return {"id": self._sample_ids(shard)[j], "input_ids": f.get_slice("input_ids")[a:b].long(),
                "loss_mask": f.get_slice("loss_mask")[a:b]}

    def sample(self, i: int) -> dict:
        shard, a, b, _ = self._samples[i]
        if shard not in self._verified:
            self._verify(shard)
        f = self._handle(shard)
        taps = f.get_slice("taps")[a:b]  # (n, K*H)
        if taps.dtype == torch.float8_e4m3fn:
            taps = dequantize_fp8(taps, f.get_slice("taps_scale")[a:b], self.dtype)
        return {**self.tokens(i), "taps": taps.to(self.dtype)}

    def __iter__(self):
        order = self._order(self.epoch)
        while self.position < len(order):
            i = order[self.position]
            self.position += 1
            yield self.sample(i)
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "rank": self.rank,
                "world": self.world, "num_samples": len(self._samples)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "world", "num_samples"):
            if state[key] != self.state_dict()[key]:
                raise ValueError(f"reader state has {key}={state[key]}, this reader {self.state_dict()[key]}: "
                                 "an exact resume needs the same shards, seed and world size")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# ---------------------------------------------------------------------------------------------
# CLI: dflash-train prepare


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflash_train.config import DataConfig, DrafterConfigSpec, TargetConfig

    data = DataConfig()
    p.add_argument("--target", default=TargetConfig().model, help="smollm2, an HF dir, a cached hub id, or a .gguf")
    p.add_argument("--data", required=True, help="JSONL / parquet / HF dataset dir with assistant turns "
                   "(e.g. the output of dflash-train regenerate)")
    p.add_argument("--out", required=True, help="shard directory (resumes an interrupted prepare)")
    p.add_argument("--format", choices=FORMATS, default="bf16", help="taps storage: bf16, or fp8 e4m3 + row scale")
    p.add_argument("--layer-ids", default=None, help="comma-separated tap ids (z-lab semantics); default z-lab ids")
    p.add_argument("--num-taps", type=int, default=DrafterConfigSpec().num_taps)
    p.add_argument("--max-len", type=int, default=data.max_len)
    p.add_argument("--min-loss-tokens", type=int, default=data.min_loss_tokens)
    p.add_argument("--thinking", choices=("on", "off"), default=None)
    p.add_argument("--skip-bad-rows", action="store_true")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=float, default=512.0, help="approximate shard size in MiB")
    p.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens per target forward")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")


def command(args: argparse.Namespace) -> int:
    """Run `dflash-train prepare`; ends with a verdict line."""
    try:
        report, out = _prepare_from_args(args)
    except Exception as e:  # the verdict line must name the cause, whatever it is
        print(f"dflash-train prepare: FAILED: {type(e).__name__}: {e}", flush=True)
        return 1
    print(f"dflash-train prepare: OK {report.samples} samples, {report.tokens} tokens in {report.shards} shards "
          f"({report.bytes / 2**20:.1f} MiB) at {out}; {report.resumed_after} were already done", flush=True)
    return 0


def _prepare_from_args(args: argparse.Namespace) -> tuple[PrepareReport, str]:
    from dflash_train.data.conversations import read_conversations, tokenize_conversations
    from dflash_train.data.text import check_data_format
    from dflash_train.model.target import build_target_layer_ids, load_target

    thinking = None if args.thinking is None else args.thinking == "on"
    conversations, bad = read_conversations(args.data, args.skip_bad_rows, args.max_samples, args.seed)
    target = load_target(args.target, dtype=args.dtype, device=args.device,
                         check_tokenizer=lambda tok: check_data_format("chat", tok, args.target))
    samples, bad = tokenize_conversations(target.tokenizer, conversations, args.max_len, args.min_loss_tokens,
                                          thinking, bad)
    print(f"prepare: {len(samples)} samples from {len(conversations)} conversations; {bad.summary()}", flush=True)
    if not samples:
        raise ValueError(f"no sample has {args.min_loss_tokens}+ supervised tokens ({bad.summary()}); "
                         "prompt-only data (such as 'default') needs `dflash-train regenerate` first")
    layer_ids = ([int(x) for x in args.layer_ids.split(",")] if args.layer_ids
                 else build_target_layer_ids(target.num_layers, args.num_taps))
    tap_width = len(layer_ids) * target.hidden_size
    shard_tokens = max(1, int(args.shard_mb * 2**20) // bytes_per_token(tap_width, args.format))
    report = prepare_shards(target, samples, args.out, layer_ids, args.format, shard_tokens,
                            args.batch_tokens, target_name=args.target)
    return report, args.out
