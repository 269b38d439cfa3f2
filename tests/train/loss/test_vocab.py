import torch

from dflash_train.train.loss.vocab import vocab_subset
from tests.train.loss.test_loss import dflash_block_loss


def test_subset_holds_every_data_token_then_the_lowest_ids():
    vocab = vocab_subset([(7, 9, 9), (12,)], vocab_size=20, size=6)
    assert vocab.ids.tolist() == [0, 1, 2, 7, 9, 12]
    assert vocab.index[vocab.ids].tolist() == list(range(6))
    assert (vocab.index >= 0).sum() == 6
    # more distinct data tokens than `size`: all of them are kept
    assert vocab_subset([(3, 4, 5)], vocab_size=20, size=2).ids.tolist() == [3, 4, 5]
    # rounded up to a multiple (training asks for 16: float8 lm_head matmuls), topped up by the lowest ids
    assert vocab_subset([(3, 4, 5, 17)], vocab_size=40, size=2, multiple=8).ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 17]


def test_labels_outside_the_subset_leave_the_loss():
    vocab = vocab_subset([(4,)], vocab_size=10, size=2)  # ids [0, 4]
    labels, valid = vocab.map_labels(torch.tensor([4, 0, 7]), torch.tensor([True, True, True]))
    assert labels.tolist() == [1, 0, 0] and valid.tolist() == [True, True, False]


def test_restricted_loss_equals_full_loss_when_the_subset_holds_every_competitor():
    """Tokens outside the subset get logits ~ -1e4 (via a constant feature), so the full softmax
    puts no mass on them: loss and gradient over the subset must equal the full ones."""
    gen = torch.Generator().manual_seed(0)
    b, n, block, hdim, vocab_size = 2, 3, 5, 8, 40
    keep_ids = [0, 1, 2, 3, 5, 8, 13, 21, 34]
    labels = torch.tensor(keep_ids)[torch.randint(0, len(keep_ids), (b, n, block), generator=gen)]
    valid = torch.rand(b, n, block, generator=gen) > 0.3
    valid[:, :, 0] = False
    weight = torch.randn(vocab_size, hdim + 1, generator=gen, dtype=torch.float64)
    weight[:, -1] = -1e4
    weight[keep_ids, -1] = 0.0
    hidden = torch.randn(b, n * block, hdim + 1, generator=gen, dtype=torch.float64)
    hidden[..., -1] = 1.0
    hidden.requires_grad_(True)

    vocab = vocab_subset([keep_ids], vocab_size, size=len(keep_ids))
    assert vocab.ids.tolist() == keep_ids
    full = dflash_block_loss(hidden, weight, labels, valid, gamma=2.0, chunk_tokens=4)
    sub_labels, sub_valid = vocab.map_labels(labels, valid)
    part = dflash_block_loss(hidden, vocab.restrict(weight), sub_labels, sub_valid, gamma=2.0, chunk_tokens=4)
    full_loss, part_loss = full.loss_sum / full.weight_sum, part.loss_sum / part.weight_sum
    (g_full,) = torch.autograd.grad(full_loss, hidden)
    (g_part,) = torch.autograd.grad(part_loss, hidden)
    torch.testing.assert_close(part_loss, full_loss, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(g_part, g_full, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(part.slot_correct, full.slot_correct)
