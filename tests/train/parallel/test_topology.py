"""Target groups in the topology: consecutive target ranks, one sender per group, and nothing
changed with groups of one."""

import pytest

from dflash_train.train.parallel.topology import Topology


def test_two_groups_of_two_and_two_drafters():
    topos = [Topology("disaggregated", 6, r, r, 4, target_group_size=2) for r in range(6)]
    first = topos[0]
    assert first.target_groups == [[0, 1], [2, 3]] and first.sender_ranks == [0, 2]
    assert first.drafter_ranks == [4, 5] and first.num_target_groups == 2
    assert [t.target_group_index for t in topos] == [0, 0, 1, 1, -1, -1]
    assert [t.is_sender for t in topos] == [True, False, True, False, False, False]
    assert [t.is_target for t in topos] == [True] * 4 + [False] * 2
    assert first.describe() == "disaggregated: 4 target ranks in 2 groups of 2 -> 2 drafter rank(s)"


def test_pipeline_groups_send_from_their_last_stage():
    topos = [Topology("disaggregated", 7, r, r, 4, target_group_size=2, target_parallel="pipeline") for r in range(7)]
    assert topos[0].sender_ranks == [1, 3] and [t.is_sender for t in topos] == [False, True, False, True] + [False] * 3
    assert [t.stage for t in topos] == [0, 1, 0, 1, -1, -1, -1] and all(t.pipeline for t in topos)
    assert topos[0].describe() == "disaggregated: 4 target ranks in 2 groups of 2 pipeline stages -> 3 drafter rank(s)"
    assert not Topology("disaggregated", 3, 0, 0, 1, target_parallel="pipeline").pipeline  # groups of one: no stages
    with pytest.raises(ValueError, match="topology.target_parallel 'stages'"):
        Topology("disaggregated", 3, 0, 0, 2, target_group_size=2, target_parallel="stages")


def test_groups_of_one_are_the_target_ranks():
    topo = Topology("disaggregated", 5, 1, 1, 3)
    assert topo.target_groups == [[0], [1], [2]] and topo.sender_ranks == topo.target_ranks == [0, 1, 2]
    assert topo.target_group_index == 1 and topo.is_sender
    assert topo.describe() == "disaggregated: 3 target rank(s) -> 2 drafter rank(s)"


def test_a_group_size_must_divide_the_target_ranks():
    with pytest.raises(ValueError, match="target_group_size=2 must divide topology.target_ranks=3"):
        Topology("disaggregated", 5, 0, 0, 3, target_group_size=2)
