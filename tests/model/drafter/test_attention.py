import pytest
import torch

from dflash_train.model.drafter.attention import MaskSpec, attend, dense_mask, flex_block_mask


def brute_force_mask(spec: MaskSpec, anchors, keep):
    """The mask rules written as plain Python loops, independently of `mask_rule`."""
    S, B, N, W = spec.context_len, spec.block_size, spec.num_anchors, spec.sliding_window
    out = torch.zeros(anchors.shape[0], 1, N * B, S + N * B, dtype=torch.bool)
    for b in range(anchors.shape[0]):
        for q in range(N * B):
            j, o = divmod(q, B)
            a = int(anchors[b, j])
            q_pos = a + o
            for kv in range(S + N * B):
                if kv < S:  # context position kv, strictly before the anchor, inside |q_pos - kv| < W
                    ok = bool(keep[b, j]) and kv < a and (W is None or q_pos - kv < W)
                else:
                    jj, oo = divmod(kv - S, B)
                    ok = jj == j and (not spec.causal or oo <= o)
                out[b, 0, q, kv] = ok
    return out


def random_anchors(batch, seq_len, n, n_valid, gen):
    anchors = torch.zeros(batch, n, dtype=torch.long)
    keep = torch.zeros(batch, n, dtype=torch.bool)
    for b in range(batch):
        pos = torch.randperm(seq_len - 1, generator=gen)[: n_valid[b]].sort().values
        pos[-1] = seq_len - 2  # one anchor near the end: its block runs past the sequence
        anchors[b, : n_valid[b]] = pos.sort().values
        keep[b, : n_valid[b]] = True
    return anchors, keep


WINDOWS = [(None, False), (5, False), (5, True), (None, True)]  # (window, causal inside the block)


@pytest.mark.parametrize("window,causal", WINDOWS)
def test_dense_mask_equals_brute_force(window, causal):
    gen = torch.Generator().manual_seed(0)
    spec = MaskSpec(context_len=23, block_size=4, num_anchors=5, sliding_window=window, causal=causal)
    anchors, keep = random_anchors(2, 23, 5, [5, 3], gen)  # row 1 has two padded blocks
    assert torch.equal(dense_mask(spec, anchors, keep), brute_force_mask(spec, anchors, keep))


def test_mask_semantics_on_a_hand_case():
    spec = MaskSpec(context_len=6, block_size=3, num_anchors=2)
    anchors, keep = torch.tensor([[2, 4]]), torch.tensor([[True, False]])
    m = dense_mask(spec, anchors, keep)[0, 0]
    assert m[0, :6].tolist() == [True, True, False, False, False, False]  # strictly before anchor 2
    assert m[2, 6:].tolist() == [True, True, True, False, False, False]  # own block, bidirectional
    assert m[3, :6].sum() == 0 and m[3, 9:].tolist() == [True, True, True]  # padded: own block only


def _qkv(gen, batch, hq, hkv, q_len, kv_len, d):
    q = torch.randn(batch, hq, q_len, d, generator=gen)
    k = torch.randn(batch, hkv, kv_len, d, generator=gen)
    v = torch.randn(batch, hkv, kv_len, d, generator=gen)
    return q, k, v


@pytest.mark.parametrize("window,causal", WINDOWS)
def test_backends_agree(window, causal):
    gen = torch.Generator().manual_seed(1)
    spec = MaskSpec(context_len=40, block_size=4, num_anchors=6, sliding_window=window, causal=causal)
    anchors, keep = random_anchors(2, 40, 6, [6, 4], gen)
    q, k, v = _qkv(gen, 2, 4, 2, spec.q_len, spec.kv_len, 16)
    mask = dense_mask(spec, anchors, keep)
    ref = attend(q.double(), k.double(), v.double(), mask, "dense")
    sdpa = attend(q, k, v, mask, "sdpa")
    torch.testing.assert_close(sdpa.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(sdpa).all()
    try:
        block_mask = flex_block_mask(spec, anchors, keep, compiled=False)
        flex = attend(q, k, v, block_mask, "flex")
    except Exception as e:  # flex is optional on CPU builds without it
        pytest.skip(f"flex_attention unavailable here: {e}")
    torch.testing.assert_close(flex.double(), ref, atol=1e-5, rtol=1e-5)


def test_flex_block_mask_matches_dense():
    gen = torch.Generator().manual_seed(2)
    spec = MaskSpec(context_len=37, block_size=4, num_anchors=5)
    anchors, keep = random_anchors(1, 37, 5, [4], gen)
    try:
        block_mask = flex_block_mask(spec, anchors, keep, compiled=False)
    except Exception as e:
        pytest.skip(f"flex_attention unavailable here: {e}")
    b = torch.zeros((), dtype=torch.long)
    dense = dense_mask(spec, anchors, keep)[0, 0]
    q_idx = torch.arange(spec.q_len)[:, None]
    kv_idx = torch.arange(spec.kv_len)[None, :]
    assert torch.equal(block_mask.mask_mod(b, b, q_idx, kv_idx), dense)


@pytest.mark.parametrize("window,causal", WINDOWS + [(9, False)])
@pytest.mark.parametrize("context_len,block,anchors_n,tile", [(64, 4, 8, 8), (37, 4, 5, 8), (48, 8, 6, 16), (30, 3, 7, 8)])
def test_analytic_block_mask_has_the_tiles_of_create_block_mask(context_len, block, anchors_n, tile, window, causal):
    """Full and partial tile sets per query tile equal those of flex's create_block_mask (which
    evaluates mask_rule on every element), aligned and unaligned lengths, padded anchors, full,
    windowed and causal layers."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash_train.model.drafter.attention import analytic_block_mask, mask_rule

    gen = torch.Generator().manual_seed(context_len)
    spec = MaskSpec(context_len=context_len, block_size=block, num_anchors=anchors_n,
                    sliding_window=None if window is None else max(window, block), causal=causal)
    anchors, keep = random_anchors(2, context_len, anchors_n, [anchors_n - 1, anchors_n - 3], gen)
    ours = analytic_block_mask(spec, anchors, keep, tile=tile)
    ref = create_block_mask(lambda b, h, q, kv: mask_rule(spec, anchors, keep, b, q, kv), B=2, H=None,
                            Q_LEN=spec.q_len, KV_LEN=spec.kv_len, device="cpu", BLOCK_SIZE=tile)

    def tile_sets(num, idx):
        return [[set(idx[b, 0, i, :num[b, 0, i]].tolist()) for i in range(num.shape[-1])] for b in range(2)]

    assert tile_sets(ours.kv_num_blocks, ours.kv_indices) == tile_sets(ref.kv_num_blocks, ref.kv_indices)
    assert tile_sets(ours.full_kv_num_blocks, ours.full_kv_indices) == \
        tile_sets(ref.full_kv_num_blocks, ref.full_kv_indices)
    assert torch.equal(ours.to_dense(), ref.to_dense())


@pytest.mark.parametrize("window,causal", WINDOWS)
def test_analytic_mask_mod_equals_mask_rule_on_every_element(window, causal):
    """The interval mask_mod the kernel evaluates in partial tiles, on the whole grid, padded query
    rows (past N*B, up to a whole tile) included, batch of 2 with padded anchors."""
    from dflash_train.model.drafter.attention import analytic_block_mask, mask_rule

    gen = torch.Generator().manual_seed(5)
    spec = MaskSpec(context_len=37, block_size=3, num_anchors=7, sliding_window=window, causal=causal)
    anchors, keep = random_anchors(2, 37, 7, [7, 4], gen)
    mask = analytic_block_mask(spec, anchors, keep, tile=8)
    b = torch.arange(2)[:, None, None]
    q = torch.arange(24)[None, :, None]  # N*B = 21, padded to 3 tiles of 8
    kv = torch.arange(spec.kv_len)[None, None, :]
    h = torch.zeros((), dtype=torch.long)
    ours = mask.mask_mod(b, h, q, kv)
    assert torch.equal(ours, mask_rule(spec, anchors, keep, b, q, kv))
    assert ours[0].sum() > ours[1].sum() > 0  # the row with padded anchors sees less context


@pytest.mark.parametrize("window,causal", WINDOWS)
def test_inference_mask_is_the_training_rule_at_one_anchor(window, causal):
    """Drafting one block after C cached positions sees what training's block of anchor C sees:
    the inference mask equals the training mask's row block for anchor C (context [0, C), own block)."""
    from dflash_train.model.drafter.attention import inference_mask

    C, B = 11, 4
    spec = MaskSpec(context_len=C, block_size=B, num_anchors=1, sliding_window=window, causal=causal)
    train = brute_force_mask(spec, torch.tensor([[C]]), torch.tensor([[True]]))[0, 0]  # [B, C + B]
    got = inference_mask(C, B, window, torch.device("cpu"), causal=causal)
    want = train if (window is not None or causal) else None
    if want is None:
        assert got is None
    else:
        assert torch.equal(got[0, 0], want)
    assert want is None or want[:, :C].any(1).all()  # every slot still sees some context
