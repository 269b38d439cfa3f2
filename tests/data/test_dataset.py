"""The held-out split shared by every data route: a hash of the sample id."""

from __future__ import annotations

from dflash_train.data.dataset import is_held_out, split_held_out
from dflash_train.data.records import Sample


def _samples(n: int) -> list[Sample]:
    return [Sample(f"s{i}", (1, 2, 3), (0, 1, 1)) for i in range(n)]


def test_split_follows_is_held_out_and_keeps_pairs_together():
    samples = _samples(2000)
    (train, train_idx), (held, held_idx) = split_held_out(samples, 0.1)
    assert [s.id for s in held] == [s.id for s in samples if is_held_out(s.id, 0.1)]  # brute force
    assert [samples[i] for i in train_idx] == train and [samples[i] for i in held_idx] == held
    assert 150 < len(held) < 250 and len(train) + len(held) == 2000
    (_, train_taps), (_, held_taps) = split_held_out(samples, 0.1, [f"taps-{s.id}" for s in samples])
    assert held_taps == [f"taps-{s.id}" for s in held] and train_taps == [f"taps-{s.id}" for s in train]


def test_a_sample_keeps_its_side_whatever_the_others():
    samples = _samples(500)
    (_, _), (held, _) = split_held_out(samples, 0.2)
    (_, _), (held_rev, _) = split_held_out(samples[::-1][:300], 0.2)
    assert {s.id for s in held_rev} == {s.id for s in held} & {s.id for s in samples[200:]}
    assert split_held_out(samples, 0.0)[1] == ([], []) and split_held_out(samples, 1.0)[0] == ([], [])
