"""Stored rows packed end to end, so a step's rows are one gather, and kept on the GPU when they fit.

The regenerate + tap cache already holds each entry as one [T, width] tensor, the samples end to end
(`data/regen_taps.TappedSamples`). Building a step from per-sample views costs the host three passes
over the step's bytes (zeros, a Python loop of row copies, then the pinned copy for the transfer):
~70 MB a step for the `gpu` recipe, ~20 ms on a quiet 2-core CPU against a ~44 ms step on an H100. Here
the step is one index [b, S] into the packed tensors. Where they sit on the GPU (`data.taps_device`),
the host never touches the step's bytes; in host memory, the gather writes straight into pinned
memory, one pass.
"""

from __future__ import annotations

import time

import torch

from dflash_train.train.feed.batching import host_to_device
from dflash_train.train.feed.taps import TapsSpec

COPY_CHUNK_BYTES = 1 << 28  # 256 MB per host-to-device copy: the move never doubles host memory
AUTO_FREE_SHARE = 0.6  # data.taps_device=auto: the rows take at most this share of the device's free memory


class PackedRows:
    """Per-sample tensors {name: [T, width]} laid end to end; sample i is rows starts[i]:starts[i]+lengths[i]."""

    def __init__(self, flat: dict[str, torch.Tensor], starts: torch.Tensor, lengths: torch.Tensor):
        self.flat, self.starts, self.lengths = flat, starts.long(), lengths.long()

    @classmethod
    def of_lengths(cls, flat: dict[str, torch.Tensor], lengths: list[int]) -> "PackedRows":
        counts = torch.tensor(lengths, dtype=torch.long)
        return cls(flat, torch.cumsum(counts, 0) - counts, counts)

    def subset(self, indices: list[int]) -> "PackedRows":
        """The samples `indices` (e.g. the training split), sharing the packed tensors."""
        pick = torch.tensor(list(indices), dtype=torch.long)
        return PackedRows(self.flat, self.starts[pick], self.lengths[pick])

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start, n = int(self.starts[i]), int(self.lengths[i])
        return {name: t[start:start + n] for name, t in self.flat.items()}

    @property
    def device(self) -> torch.device:
        return next(iter(self.flat.values())).device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())

    def padded(self, indices: list[int], seq_len: int, spec: TapsSpec, pinned: bool = False) -> dict[str, torch.Tensor]:
        """Samples `indices` zero-padded (or cut) to [b, S, width] per entry of `spec`, on the rows' device;
        the same tensors as `TapsSpec.padded` of the per-sample rows. `pinned`: host rows are written into
        pinned memory (ready for a non-blocking copy to a GPU)."""
        if self.device.type == "cpu":
            return {f.name: self._host_gather(f.name, indices, seq_len, pinned).to(f.dtype) for f in spec.fields}
        return self._device_gather(indices, seq_len, spec)

    def _device_gather(self, indices: list[int], seq_len: int, spec: TapsSpec) -> dict[str, torch.Tensor]:
        """One index [b*S] into each packed tensor, the padding masked to zero: a few kernels on a GPU."""
        pick = torch.tensor(list(indices), dtype=torch.long)
        positions = torch.arange(seq_len)
        valid = positions[None] < self.lengths[pick][:, None]  # [b, S]
        index = torch.where(valid, self.starts[pick][:, None] + positions[None], 0).reshape(-1)  # [b*S]
        index, valid = host_to_device(index, self.device), host_to_device(valid, self.device)  # pinned: no GPU wait
        out = {}
        for f in spec.fields:
            source = self.flat[f.name]
            gathered = source.index_select(0, index).view(len(pick), seq_len, source.shape[1])  # [b, S, width]
            out[f.name] = gathered.masked_fill_(~valid[..., None], 0).to(f.dtype)
        return out

    def _host_gather(self, name: str, indices: list[int], seq_len: int, pinned: bool) -> torch.Tensor:
        """One pass over the step's bytes: each sample's rows copied in, only the padding zeroed (on a CPU,
        slice copies of whole samples beat `index_select` of thousands-wide rows: docs/PERF.md 8)."""
        source = self.flat[name]
        out = torch.empty(len(indices), seq_len, source.shape[1], dtype=source.dtype, pin_memory=pinned)
        for row, i in enumerate(indices):
            start, n = int(self.starts[i]), min(seq_len, int(self.lengths[i]))
            out[row, :n].copy_(source[start:start + n])
            out[row, n:].zero_()
        return out

    def to(self, device: torch.device) -> "PackedRows":
        """The packed tensors copied to `device` in chunks (a memory-mapped source is read once, in order)."""
        moved = {}
        for name, t in self.flat.items():
            dest = torch.empty(t.shape, dtype=t.dtype, device=device)
            rows = max(1, COPY_CHUNK_BYTES // max(1, t[0].numel() * t.element_size()))
            for start in range(0, t.shape[0], rows):
                dest[start:start + rows].copy_(t[start:start + rows])
            moved[name] = dest
        return PackedRows(moved, self.starts, self.lengths)


def placement(mode: str, nbytes: int, device: torch.device, free_bytes: int | None) -> tuple[bool, str]:
    """(on the device?, why) for `data.taps_device` = auto | host | device, `nbytes` of rows and the
    device's free memory (None on a CPU)."""
    size = f"{nbytes / 1e9:.1f} GB"
    if device.type != "cuda":
        return False, f"{size} in host memory (the step runs on the {device.type})"
    if mode == "host":
        return False, f"{size} in host memory (data.taps_device=host)"
    if mode == "device":
        return True, f"{size} on {device} (data.taps_device=device)"
    share = nbytes / max(1, free_bytes or 0)
    if share <= AUTO_FREE_SHARE:
        return True, (f"{size} on {device}, {share:.0%} of its free {free_bytes / 1e9:.1f} GB (data.taps_device=auto: "
                      f"up to {AUTO_FREE_SHARE:.0%}; set data.taps_device=host if the step runs out of memory)")
    return False, (f"{size} in host memory: {share:.0%} of {device}'s free {free_bytes / 1e9:.1f} GB, over "
                   f"data.taps_device=auto's {AUTO_FREE_SHARE:.0%} (data.taps_device=device moves them anyway)")


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device, counting what this process's allocator caches but does not use."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def place(rows: tuple[PackedRows, PackedRows], mode: str, device: torch.device, log) -> tuple[PackedRows, PackedRows]:
    """The (train, held-out) rows where `data.taps_device` puts them, said in one line."""
    train, held_out = rows
    nbytes = train.nbytes  # both splits share the packed tensors
    on_device, why = placement(mode, nbytes, device, free_device_bytes(device))
    if not on_device:
        log(f"data: stored taps: {why}; each step gathers its rows in one pass")
        return rows
    start = time.perf_counter()
    moved = train.to(device)
    held = PackedRows(moved.flat, held_out.starts, held_out.lengths)
    seconds = time.perf_counter() - start
    log(f"data: stored taps: {why}, moved in {seconds:.1f}s ({nbytes / 1e9 / max(seconds, 1e-9):.1f} GB/s); "
        "each step gathers its rows there, the host copies none of them")
    return moved, held
