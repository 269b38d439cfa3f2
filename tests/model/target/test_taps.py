"""Tap indexing (z-lab semantics) against the decoder layers' own outputs, recorded by hooks."""

from __future__ import annotations

import pytest
import torch

from dflash_train.model.target.taps import check_layer_ids, hidden_state_index, select_taps
from dflash_train.model.target.target import Target
from tests.conftest import tiny_qwen3


@pytest.fixture(scope="module")
def tiny():
    return Target(model=tiny_qwen3(vocab_size=300, seed=3), tokenizer=None, name="tiny")


def _layer_outputs(target: Target, ids: torch.Tensor) -> tuple[list[torch.Tensor], object]:
    """Every decoder layer's output, recorded by hooks (no HF indexing involved), and HF's output."""
    outputs = [None] * target.num_layers
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i, layer in enumerate(target.layers)]
    try:
        out = target.model(input_ids=ids, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    return outputs, out


def test_tap_i_is_the_output_of_decoder_layer_i(tiny):
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    outputs, out = _layer_outputs(tiny, ids)
    last = tiny.num_layers - 1
    for layer_ids in ([0], [1, 3], [4, 0, 2]):
        want = torch.cat([outputs[i] for i in layer_ids], dim=-1)  # (b, S, K*H)
        torch.testing.assert_close(select_taps(out.hidden_states, layer_ids), want, rtol=0, atol=0)
    # HF's last hidden state is taken after the final norm, and so is a tap of the last layer
    torch.testing.assert_close(select_taps(out.hidden_states, [last]), tiny.final_norm(outputs[last]))
    assert [hidden_state_index(i) for i in range(3)] == [1, 2, 3]


def test_a_mapping_of_recorded_states_selects_like_the_hf_tuple(tiny):
    ids = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(1))
    _, out = _layer_outputs(tiny, ids)
    recorded = {hidden_state_index(i): out.hidden_states[hidden_state_index(i)] for i in (2, 4)}
    torch.testing.assert_close(select_taps(recorded, [4, 2]), select_taps(out.hidden_states, [4, 2]), rtol=0, atol=0)


@pytest.mark.parametrize("layer_ids", [[1, 3], [5, 0, 2], [5]])
def test_target_taps_equal_hf_hidden_states(tiny, layer_ids):
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(2))
    _, out = _layer_outputs(tiny, ids)
    torch.testing.assert_close(tiny.taps(ids, None, layer_ids), select_taps(out.hidden_states, layer_ids),
                               rtol=1e-5, atol=1e-5)


def test_layer_ids_are_checked():
    assert check_layer_ids((torch.tensor(2), 0), 6) == [2, 0]
    for bad in ([], [6], [-1, 2]):
        with pytest.raises(ValueError, match=r"tap layer ids .*in \[0, 6\)"):
            check_layer_ids(bad, 6)


@pytest.mark.parametrize("side", ["right", "left"])
def test_pitfall_3_taps_of_a_padded_batch_equal_each_row_alone(tiny, side):
    """Published pitfall 3 (speculators #279: batched hidden-state capture leaked between requests):
    the taps of rows of different lengths forwarded as one padded batch (the colocated and
    disaggregated prefill) equal each row's taps at batch 1 at every real position, padded on the
    right (training's micro-batches) or on the left (generation)."""
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, 300, (n,), generator=g) for n in (9, 4, 7)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        place = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
        ids[i, place], mask[i, place] = r, 1
    batched = tiny.taps(ids, mask, [1, 3])
    for i, r in enumerate(rows):
        alone = tiny.taps(r[None], None, [1, 3])[0]
        place = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
        torch.testing.assert_close(batched[i, place], alone, rtol=1e-5, atol=1e-5)
