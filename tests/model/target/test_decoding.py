"""Left padding and mask positions: a left-padded batch gives each row what it gives alone."""

from __future__ import annotations

import torch

from dflash_train.model.target.decoding import left_pad, mask_positions
from tests.conftest import tiny_qwen3


def test_left_pad_right_aligns_rows():
    ids, mask = left_pad([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long
    assert mask_positions(mask).tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 1]]


def test_padded_batch_equals_rows_alone():
    model = tiny_qwen3(vocab_size=300, seed=4)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in (7, 3, 5)]
    ids, mask = left_pad(rows, pad_id=0)
    batched = model(input_ids=ids, attention_mask=mask, position_ids=mask_positions(mask)).logits
    for r, row in enumerate(rows):
        alone = model(input_ids=torch.tensor([row])).logits[0]  # (n, V)
        torch.testing.assert_close(batched[r, ids.shape[1] - len(row):], alone, rtol=1e-4, atol=1e-4)
