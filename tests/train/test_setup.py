"""Which target weights a rank holds: the whole target where it runs the target's forward, else
(a disaggregated drafter rank) only what it reads."""

from __future__ import annotations

import pytest

from dflash_train.config import apply_overrides
from dflash_train.model.target_subset import TargetSubset
from dflash_train.recipes import tiny
from dflash_train.train.setup import target_subset
from dflash_train.train.topology import Topology


def _cfg(*overrides: str):
    return apply_overrides(tiny(), ["data.regenerate=false", "drafter.num_layers=2", *overrides])


def _disaggregated(rank: int) -> Topology:  # ranks 0-1: one target group of 2; ranks 2-3: drafters
    return Topology("disaggregated", world_size=4, rank=rank, local_rank=rank, num_target_ranks=2,
                    target_group_size=2)


@pytest.mark.parametrize("rank", [2, 3])
def test_drafter_ranks_hold_what_the_drafter_reads_and_copies(rank):
    assert target_subset(_cfg(), _disaggregated(rank), print) == TargetSubset(last_layers=2, final_norm=True)
    assert target_subset(_cfg("drafter.init_from_target=false"), _disaggregated(rank), print) == TargetSubset()


def test_ranks_that_run_the_target_hold_all_of_it():
    assert target_subset(_cfg(), _disaggregated(0), print) is None
    assert target_subset(_cfg(), Topology("colocated", 2, 1, 1, 0), print) is None


def test_the_main_drafter_rank_keeps_the_whole_target_to_regenerate():
    said = []
    assert target_subset(_cfg("data.regenerate=true"), _disaggregated(2), said.append) is None
    assert "data.regenerate" in said[0] and "dflash-train regenerate" in said[0]
    assert target_subset(_cfg("data.regenerate=true"), _disaggregated(3), said.append) == \
           TargetSubset(last_layers=2, final_norm=True)


def test_data_caches_are_keyed_by_the_targets_numerics(tiny_qwen3_target):
    """A bf16 or FP8 target answers and taps differently from a float32 one: their data caches in a
    shared work dir must not be read by a run with other numerics (keys name dtype and precision)."""
    import copy

    import torch

    from dflash_train.data.dataset import cache_key
    from dflash_train.train.setup import data_source_name

    cfg = _cfg()
    bf16 = copy.deepcopy(tiny_qwen3_target)
    bf16.model.to(torch.bfloat16)
    names = {data_source_name(cfg, tiny_qwen3_target), data_source_name(cfg, bf16),
             data_source_name(_cfg("target.precision=fp8"), tiny_qwen3_target)}
    assert len(names) == 3, names
    assert len({cache_key(cfg.data, name, 0) for name in names}) == 3
    assert data_source_name(cfg, tiny_qwen3_target) == f"{cfg.target.model}|float32"
