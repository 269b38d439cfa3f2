"""The balance report's suggested layout, in whole target groups."""

from dflash_train.train.feed.balance import suggest_target_ranks


def test_single_target_ranks_split_the_world_by_the_ratio():
    assert suggest_target_ranks(8, 1, 1.0) == 4  # as fast as a drafter: half the ranks
    assert suggest_target_ranks(8, 1, 3.0) == 6
    assert suggest_target_ranks(8, 1, 100.0) == 7  # always one drafter rank left
    assert suggest_target_ranks(8, 1, 0.01) == 1  # always one target rank


def test_groups_are_suggested_whole():
    # 2 groups of 2 per drafter rank: 4 + 2 of 6 processes, n * 2 + d = 6 with n = 2d
    assert suggest_target_ranks(6, 2, 2.0) == 4
    assert suggest_target_ranks(8, 4, 0.5) == 4  # 8 * 0.5 / (1 + 4 * 0.5) = 1.3 -> 1 group of 4 + 4 drafters
    assert suggest_target_ranks(8, 4, 10.0) == 4  # a second group would leave no drafter rank
