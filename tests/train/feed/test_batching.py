"""Micro-batches built with the per-sample tensor cache (train/feed/batching.py `collate`, `SampleTensors`) equal
the ones a reference builds from the samples' tuples (the padded row's own eligible positions, `sample_anchors`),
anchors included, for every epoch and for samples cut to the batch's length; the cache is keyed by the sample
object, so repeated ids cannot mix two samples."""

import random

import torch

from dflash_train.data.anchors import anchor_generator, eligible_anchors, sample_anchors
from dflash_train.data.records import Sample
from dflash_train.train.feed.batching import SampleTensors, collate, padded_length


def _samples(count: int, seed: int = 0) -> list[Sample]:
    """Prompts of 5-40 unsupervised tokens, then answers with unsupervised gaps, 20-90 tokens in all."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n, prompt = rng.randint(20, 90), rng.randint(5, 40)
        mask = [0] * min(prompt, n) + [int(rng.random() > 0.1) for _ in range(max(0, n - prompt))]
        out.append(Sample(f"s{i % 7}", tuple(rng.randrange(1000) for _ in range(n)), tuple(mask)))  # ids repeat
    return out


def _reference(samples: list[Sample], epoch: int, seed: int, num_anchors: int, pad_multiple: int, max_len: int):
    """collate as it was before the cache: each row rebuilt from the tuples, anchors from the padded row."""
    seq_len = padded_length([len(s) for s in samples], pad_multiple, max_len)
    ids = torch.zeros(len(samples), seq_len, dtype=torch.long)
    mask, attention = torch.zeros_like(ids), torch.zeros_like(ids)
    anchors = torch.zeros(len(samples), num_anchors, dtype=torch.long)
    keep = torch.zeros(len(samples), num_anchors, dtype=torch.bool)
    for row, s in enumerate(samples):
        n = min(len(s), seq_len)
        ids[row, :n], mask[row, :n] = torch.tensor(s.input_ids[:n]), torch.tensor(s.loss_mask[:n])
        attention[row, :n] = 1
        anchors[row], keep[row] = sample_anchors(mask[row], num_anchors, anchor_generator(seed, epoch, s.id))
    return [ids, mask, attention, anchors, keep]


def _fields(mb) -> list[torch.Tensor]:
    return [mb.input_ids, mb.loss_mask, mb.attention_mask, mb.anchors, mb.keep]


def test_the_cached_batches_equal_the_rebuilt_ones_over_epochs_and_cut_samples():
    samples, cache = _samples(24), {}
    for epoch in range(3):
        for start in range(0, 24, 6):
            group = samples[start:start + 6]
            for max_len in (64, 128):  # 64 cuts the longer samples: their anchors must stop before the cut
                want = _reference(group, epoch, 5, 12, 8, max_len)
                got = collate(group, epoch, 5, 12, 8, max_len, cache)
                assert got.ids == [s.id for s in group]
                for a, b in zip(_fields(got), want):
                    assert torch.equal(a, b)
    assert len(cache) == 24  # one entry per sample object, though only 7 ids


def test_the_eligible_anchors_of_a_cut_sample_are_those_of_its_cut_mask():
    sample = _samples(1, seed=3)[0]
    tensors = SampleTensors(sample)
    for n in range(1, len(sample) + 1):
        assert torch.equal(tensors.eligible_before(n), eligible_anchors(torch.tensor(sample.loss_mask[:n])))
