"""Offline hidden-state shards (`dflash-train prepare`) and their reader.

Shard `shard-NNNNN.safetensors` holds, for the samples it covers, concatenated along tokens:
- `input_ids` int32 (T,), `loss_mask` uint8 (T,), `offsets` int64 (n+1,) (sample i is rows
  offsets[i]:offsets[i+1]);
- `taps` (T, K*H): bf16, or fp8 e4m3 (`torch.float8_e4m3fn`) with `taps_scale` fp32 (T,), one
  scale per token row: taps ~= taps_fp8.float() * taps_scale[:, None]. After scaling by
  amax/448 every element is within max(2^-4 |x|, 2^-10 * scale) of the original (3 mantissa bits
  give relative error <= 2^-4 in the normal range; below 2^-6 the subnormal spacing 2^-9 rules);
- `final_hidden` (T, H), only when prepared for a distillation loss (loss.kind != ce): the
  target's last hidden state after its final norm, stored like `taps` (with `final_hidden_scale`).
`index.json` lists complete shards only (sample and token counts, sha256), with the dtype,
layer_ids, target name, hidden size and `entries` (the per-token tensors every shard holds; an
index without it holds "taps" only). Every shard and every index update is written to a temp
file, fsync'd and renamed, so a killed prepare resumes after the last complete shard.
"""

from __future__ import annotations

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
from dflash_train.data.records import TokenizedSample

SCHEMA_VERSION = 1
INDEX_NAME = "index.json"
LOCK_NAME = ".prepare.lock"  # held by the one prepare writing the directory
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FORMATS = ("bf16", "fp8")
ENTRIES = ("taps", "final_hidden")  # the per-token tensors a shard can hold, in this order


# ---------------------------------------------------------------------------------------------
# Encoding


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (token) scaled fp8 e4m3: (T, D) -> (fp8 (T, D), fp32 scale (T,))."""
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # (T,)
    return (x / scale[:, None]).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)  # (T, D)


def bytes_per_token(tap_width: int, fmt: str, final_width: int = 0) -> int:
    """Stored bytes per token: ids (4) + mask (1) + per stored entry of width D (taps, and the
    final hidden state when `final_width`): 2*D for bf16, D + 4 (scale) for fp8."""
    widths = [tap_width] + ([final_width] if final_width else [])
    return 5 + sum(2 * d if fmt == "bf16" else d + 4 for d in widths)


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
    """Samples and their per-token tensors ({name: [n, D]}) accumulated for the next shard, already
    in the storage dtype (fp8 adds `{name}_scale`)."""

    fmt: str

    def __post_init__(self):
        self.ids, self.masks, self.sample_ids = [], [], []
        self.stored: dict[str, list[torch.Tensor]] = {}

    @property
    def tokens(self) -> int:
        return sum(len(m) for m in self.masks)

    def add(self, sample: TokenizedSample, tensors: dict[str, torch.Tensor]) -> None:
        self.ids.append(torch.tensor(sample.input_ids, dtype=torch.int32))
        self.masks.append(torch.tensor(sample.loss_mask, dtype=torch.uint8))
        self.sample_ids.append(sample.id)
        for name, t in tensors.items():
            if self.fmt == "fp8":
                q, scale = quantize_fp8(t)
                self.stored.setdefault(name, []).append(q.cpu())
                self.stored.setdefault(f"{name}_scale", []).append(scale.cpu())
            else:
                self.stored.setdefault(name, []).append(t.to(torch.bfloat16).cpu())

    def tensors(self) -> dict[str, torch.Tensor]:
        lengths = torch.tensor([0] + [len(m) for m in self.masks], dtype=torch.int64)
        return {"input_ids": torch.cat(self.ids), "loss_mask": torch.cat(self.masks),
                "offsets": lengths.cumsum(0), **{name: torch.cat(parts) for name, parts in self.stored.items()}}


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
    index.setdefault("entries", ["taps"])  # written before entries were recorded
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


def _batch_tensors(target, batch: list[TokenizedSample], layer_ids, final_hidden: bool) -> list[dict]:
    """{"taps" [n, K*H], "final_hidden" [n, H] when asked} of each sample (its own length) from one
    right-padded forward."""
    width = max(len(s.input_ids) for s in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
        mask[i, : len(s.input_ids)] = 1
    out = target.taps(ids, mask, layer_ids, return_last_hidden=final_hidden)
    per_name = dict(zip(ENTRIES, out)) if final_hidden else {"taps": out}  # name -> (b, W, D)
    return [{name: t[i, : len(s.input_ids)] for name, t in per_name.items()} for i, s in enumerate(batch)]


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
                   on_shard: Callable[[int], None] | None = None, final_hidden: bool = False) -> PrepareReport:
    """Write `samples` with their taps (and, with `final_hidden`, the target's final hidden state,
    for a distillation loss) as shards under `out_dir`; resumes a killed run (module doc).

    `on_shard(shard_number)` runs after each shard and its index entry are durably written.
    A second prepare into a directory still being written is refused (`cache.CacheBusy`), never
    interleaved: it holds the lock `out_dir/.prepare.lock` (released when its process dies).
    """
    if fmt not in FORMATS:
        raise ValueError(f"shard format {fmt!r}: expected one of {FORMATS}")
    out_dir = Path(out_dir)
    with cache.exclusive(out_dir / LOCK_NAME, f"the shard directory {out_dir}", wait=False):
        return _prepare_locked(target, samples, out_dir, layer_ids, fmt, shard_tokens, batch_tokens, target_name,
                               on_shard, final_hidden)


def _prepare_locked(target, samples: list[TokenizedSample], out_dir: Path, layer_ids, fmt: str, shard_tokens: int,
                    batch_tokens: int, target_name: str | None, on_shard, final_hidden: bool = False) -> PrepareReport:
    layer_ids = [int(i) for i in layer_ids]
    tap_width = len(layer_ids) * target.hidden_size
    meta = {"schema": SCHEMA_VERSION, "target": target_name or target.name, "layer_ids": layer_ids,
            "hidden_size": target.hidden_size, "tap_width": tap_width, "dtype": fmt,
            "samples_fingerprint": samples_fingerprint(samples), "total_samples": len(samples),
            "entries": list(ENTRIES[:2 if final_hidden else 1])}
    index = _open_index(out_dir, meta)
    _remove_leftovers(out_dir, index)
    done = sum(s["samples"] for s in index["shards"])
    remaining = samples[done:]
    bpt = bytes_per_token(tap_width, fmt, target.hidden_size if final_hidden else 0)
    todo_tokens = sum(len(s.input_ids) for s in remaining)
    print(f"prepare: storage estimate {bpt} bytes/token x {todo_tokens} tokens = {bpt * todo_tokens / 2**20:.1f} MiB "
          f"({fmt}, {'+'.join(meta['entries'])}: taps {layer_ids} x hidden {target.hidden_size}); {done} samples "
          "already done", flush=True)
    check_disk_space(out_dir, int(bpt * todo_tokens * 1.02) + (1 << 20))
    buffer = _ShardBuffer(fmt)
    bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc="prepare", dynamic_ncols=True)
    for batch in _batches(remaining, batch_tokens):
        for sample, tensors in zip(batch, _batch_tensors(target, batch, layer_ids, final_hidden)):
            buffer.add(sample, tensors)
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


def follow_prepare(target, samples: list[TokenizedSample], out_dir: str | Path, layer_ids, batch_tokens: int = 16384,
                   final_hidden: bool = False) -> None:
    """A target group member that does not write: the same forwards as the group's writer (the
    sharded target's collectives need every member), over the same batches, nothing stored.
    The index read here predates the writer's first new shard: that shard needs this rank's
    first forward."""
    index_path = Path(out_dir) / INDEX_NAME
    done = sum(s["samples"] for s in json.loads(index_path.read_text())["shards"]) if index_path.exists() else 0
    for batch in _batches(samples[done:], batch_tokens):
        _batch_tensors(target, batch, [int(i) for i in layer_ids], final_hidden)


def group_dir(out_dir: str | Path, group: int) -> Path:
    """Where target group `group` of a multi-group prepare writes its share (its own index)."""
    return Path(out_dir) / f"group-{group:05d}"


def group_share(samples: list[TokenizedSample], group: int, num_groups: int) -> list[TokenizedSample]:
    """Group `group`'s contiguous share of the samples (sizes differ by at most one)."""
    bounds = [len(samples) * g // num_groups for g in range(num_groups + 1)]
    return samples[bounds[group]:bounds[group + 1]]


def merge_group_indexes(out_dir: str | Path, samples: list[TokenizedSample], num_groups: int) -> PrepareReport:
    """The top `index.json` over every group's complete shards, in group order (file names relative
    to `out_dir`), so `ShardReader(out_dir)` reads them as one set. Run once all groups finished."""
    out_dir, shards, meta = Path(out_dir), [], None
    for g in range(num_groups):
        path = group_dir(out_dir, g) / INDEX_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{path}: target group {g} wrote no index; re-run prepare to resume it")
        index = json.loads(path.read_text())
        if not index.get("complete"):
            raise ValueError(f"{path}: target group {g} did not finish ('complete' is false); re-run prepare")
        meta = meta or index
        shards += [{**s, "file": f"{path.parent.name}/{s['file']}"} for s in index["shards"]]
    keep = ("schema", "target", "layer_ids", "hidden_size", "tap_width", "dtype", "entries")
    merged = {**{k: meta[k] for k in keep}, "samples_fingerprint": samples_fingerprint(samples),
              "total_samples": len(samples), "groups": num_groups, "shards": shards, "complete": True}
    _write_index(out_dir, merged)
    return PrepareReport(len(shards), sum(s["samples"] for s in shards), sum(s["tokens"] for s in shards),
                         sum((out_dir / s["file"]).stat().st_size for s in shards), 0)


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
    """Samples `{"id", "input_ids" int64 (n,), "loss_mask" uint8 (n,), "taps" (n, K*H) in `dtype`,
    "final_hidden" (n, H) when stored (`entries`)}` from the complete shards of `index.json`.

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

    @property
    def entries(self) -> list[str]:
        """The per-token tensors stored for every sample ("taps", and "final_hidden" for distillation)."""
        return list(self.index.get("entries", ["taps"]))

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
        out = self.tokens(i)
        for name in self.entries:
            t = f.get_slice(name)[a:b]  # (n, D)
            if t.dtype == torch.float8_e4m3fn:
                t = dequantize_fp8(t, f.get_slice(f"{name}_scale")[a:b], self.dtype)
            out[name] = t.to(self.dtype)
        return out

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
