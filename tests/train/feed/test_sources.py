"""The stored source's held-out micro-batches: each filled with its own samples' stored rows, in order, whatever
the number of samples a micro-batch holds (`setup.eval_batches(..., per_batch)`; the loop uses train.micro_batch)."""

import pytest
import torch

from dflash_train.data.records import Sample
from dflash_train.train import setup
from dflash_train.train.feed.batching import BatchPlan
from dflash_train.train.feed.packed import PackedRows
from dflash_train.train.feed.sources import CollateArgs, Feed, StoredSource
from dflash_train.train.feed.taps import FINAL_HIDDEN, StoredRows, TapsSpec, TensorField

SPEC = TapsSpec((TensorField("taps", 6, torch.float32), TensorField(FINAL_HIDDEN, 3, torch.float32)))
LENGTHS = [7, 12, 5, 9, 11]


def _samples():
    return [Sample(f"h{i}", tuple(range(1, n + 1)), (0, 0) + (1,) * (n - 2)) for i, n in enumerate(LENGTHS)]


def _rows():
    gen = torch.Generator().manual_seed(0)
    return [{f.name: torch.randn(n, f.width, generator=gen) for f in SPEC.fields} for n in LENGTHS]


@pytest.mark.parametrize("per_batch", [1, 2, 5])
@pytest.mark.parametrize("packed", [False, True])
def test_held_out_micro_batches_carry_their_own_samples_rows(per_batch, packed):
    rows = _rows()
    store = (PackedRows.of_lengths({n: torch.cat([r[n] for r in rows]) for n in SPEC.names}, LENGTHS) if packed
             else StoredRows.in_memory(rows, SPEC.names))
    held_out = setup.eval_batches(_samples(), 4, 1, 64, per_batch=per_batch)
    assert [len(mb.ids) for mb in held_out] == [min(per_batch, len(LENGTHS) - i) for i in range(0, 5, per_batch)]
    feed = Feed(_samples(), BatchPlan(2, 1, 1), CollateArgs(0, 4, 1, 64), held_out, SPEC, 0)
    filled = StoredSource(feed, 0, store, store, torch.device("cpu")).held_out()
    reference = StoredRows.in_memory(rows, SPEC.names)
    first = 0
    for mb in filled:
        count, seq_len = len(mb.ids), mb.input_ids.shape[1]
        assert seq_len == max(LENGTHS[first:first + count])  # right-padded to the longest of its samples
        want = reference.padded(list(range(first, first + count)), seq_len, SPEC)
        for name in SPEC.names:
            assert torch.equal(mb.from_target[name], want[name]), (per_batch, first, name)
        for row in range(count):  # its tokens and anchors are its own sample's, the padding kept out
            n = LENGTHS[first + row]
            assert mb.input_ids[row, :n].tolist() == list(range(1, n + 1)) and not mb.attention_mask[row, n:].any()
            assert mb.keep[row].sum() == min(4, n - 3)
        first += count
    assert first == len(LENGTHS)
