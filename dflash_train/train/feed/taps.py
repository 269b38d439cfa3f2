"""What travels from the target to the drafter: a named bundle of per-token tensors.

`TapsSpec` lists the bundle's entries (name, width per token, dtype) in a fixed order; every route
(computed in-process, received from target ranks, read from stored rows) allocates, sends, pads
and copies by iterating over it, and `target_tensors` is the one producer on the target's side.
A new tensor (e.g. the target's final hidden state for distillation) is one more `TensorField` in
`taps_spec` and one more entry in `target_tensors`; nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_train.model.drafter.config import DrafterConfig
from dflash_train.train.feed.batching import MicroBatch, host_to_device


@dataclass(frozen=True)
class TensorField:
    name: str
    width: int  # per token
    dtype: torch.dtype


@dataclass(frozen=True)
class TapsSpec:
    fields: tuple[TensorField, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def bytes_per_token(self) -> int:
        return sum(f.width * f.dtype.itemsize for f in self.fields)

    def empty(self, batch: int, seq_len: int, device) -> dict[str, torch.Tensor]:
        """Receive buffers [b, S, width] of every entry, in order."""
        return {f.name: torch.empty(batch, seq_len, f.width, dtype=f.dtype, device=device) for f in self.fields}

    def padded(self, rows: list[dict[str, torch.Tensor]], seq_len: int) -> dict[str, torch.Tensor]:
        """Stored per-sample rows ({name: [n_i, width]}) zero-padded (or cut) to [b, S, width]."""
        out = {}
        for f in self.fields:
            t = torch.zeros(len(rows), seq_len, f.width, dtype=f.dtype)
            for r, row in enumerate(rows):
                n = min(seq_len, row[f.name].shape[0])
                t[r, :n] = row[f.name][:n].to(f.dtype)
            out[f.name] = t
        return out


FINAL_HIDDEN = "final_hidden"  # the target's last hidden state after its final norm: teacher logits


def taps_spec(dcfg: DrafterConfig, dtype: torch.dtype, final_hidden: bool = False) -> TapsSpec:
    """The bundle this run's drafter trains on. The place to add an entry (then add its producer
    in `target_tensors`, and the data writers for stored taps).

    "taps" [K*H]: the tapped layers' outputs; "final_hidden" [H] only when the loss reads the
    target's distribution (`LossConfig.needs_target_hidden`): a CE run does not pay for it."""
    fields = [TensorField("taps", dcfg.num_taps * dcfg.hidden_size, dtype)]
    if final_hidden:
        fields.append(TensorField(FINAL_HIDDEN, dcfg.hidden_size, dtype))
    return TapsSpec(tuple(fields))


def target_tensors(target, layer_ids, mb: MicroBatch, device, spec: TapsSpec) -> dict[str, torch.Tensor] | None:
    """The target's side of the bundle for one micro-batch, in `spec` order: {"taps": [b, S, K*H],
    "final_hidden": [b, S, H] when in the spec}, contiguous (ready to send), in the target's dtype; None
    on a pipeline stage that passes its share on (only the last stage holds the bundle)."""
    with_final = FINAL_HIDDEN in spec.names
    with torch.no_grad():
        out = target.taps(host_to_device(mb.input_ids, device), host_to_device(mb.attention_mask, device), layer_ids,
                          return_last_hidden=with_final)
    if out is None:  # a pipeline stage before the last: its share went to the next stage
        return None
    taps, final = out if with_final else (out, None)
    produced = {"taps": taps, FINAL_HIDDEN: final}
    return {name: produced[name].contiguous() for name in spec.names}


class StoredRows:
    """Per-sample stored tensors by name: `rows[i]` -> {name: [n_i, width]}. In memory (regenerate
    + tap) or read from shards when a step needs them (shards can be TBs)."""

    def __init__(self, fetch, count: int):
        self.fetch, self.count = fetch, count

    @classmethod
    def in_memory(cls, rows: list[dict[str, torch.Tensor]], spec_names: tuple[str, ...]) -> "StoredRows":
        return cls(lambda i: pick_entries(rows[i], spec_names), len(rows))

    @classmethod
    def from_shards(cls, reader, spec_names: tuple[str, ...], rows: list[int]) -> "StoredRows":
        return cls(lambda i: pick_entries(reader.sample(rows[i]), spec_names), len(rows))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.fetch(i)

    def padded(self, indices: list[int], seq_len: int, spec: TapsSpec, pinned: bool = False) -> dict[str, torch.Tensor]:
        """Samples `indices` padded to [b, S, width] per entry (host memory; `pinned` is for `PackedRows`)."""
        return spec.padded([self[i] for i in indices], seq_len)

    def __len__(self) -> int:
        return self.count


def pick_entries(sample: dict, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """`sample`'s tensors `names`; a missing one is a KeyError that says how to get it."""
    missing = [n for n in names if n not in sample]
    if missing:
        raise KeyError(f"stored rows lack {missing}: {_missing_fix(missing)}")
    return {n: sample[n] for n in names}


def _missing_fix(missing: list[str]) -> str:
    if FINAL_HIDDEN in missing:
        return ("the loss (loss.kind != ce) needs the target's final hidden state; re-run `dflash-train prepare` "
                "with the same loss.kind so the shards store it")
    return "re-run `dflash-train prepare` with a version that writes them"
