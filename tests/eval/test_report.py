"""tau, per-position acceptance, histogram and speed figures on hand-made cases; plots and table."""

import statistics

import pytest

from dflash_train.eval.report import HISTOGRAM_PNG, PER_POSITION_PNG, acceptance_stats, plot, summarize, summary_table
from dflash_train.eval.spec_decode import GenResult, SpecResult


def test_acceptance_stats_by_hand():
    # five verification steps of a B=4 drafter: accepted 0, 3, 1, 3, 2 -> emitted 1, 4, 2, 4, 3 tokens
    s = acceptance_stats([0, 3, 1, 3, 2], block_size=4)
    assert s["tau"] == pytest.approx(14 / 5)  # 2.8 tokens per target forward
    assert s["per_position_acceptance"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert s["accepted_length_histogram"] == [1, 1, 1, 2]
    assert s["steps"] == 5
    assert s["tau"] == pytest.approx(1 + sum(s["per_position_acceptance"]))  # tau = 1 + sum_k P(slot k accepted)


def test_acceptance_stats_edge_cases():
    assert acceptance_stats([], 4) == {"tau": 0.0, "steps": 0, "per_position_acceptance": [0.0, 0.0, 0.0],
                                       "accepted_length_histogram": [0, 0, 0, 0]}
    assert acceptance_stats([0, 0], 2)["tau"] == 1.0  # nothing accepted: one token per forward
    with pytest.raises(ValueError, match="accepted counts"):
        acceptance_stats([4], 4)


def test_summarize_pools_steps_and_times():
    spec = [SpecResult([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [3, 3, 1], 4, 2.0, False, prefill_seconds=0.5),
            SpecResult([5] * 20, [0, 2, 3], 4, 3.0, True, prefill_seconds=1.5)]
    plain = [GenResult([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4.0, False, 0.4), GenResult([6] * 20, 6.0, True, 0.6)]
    s = summarize(spec, plain, block_size=4)
    assert spec[0].tau == pytest.approx(10 / 3)
    assert s["tau"] == pytest.approx((4 + 4 + 2 + 1 + 3 + 4) / 6)  # pooled over steps, not prompts
    assert s["per_position_acceptance"] == pytest.approx([5 / 6, 4 / 6, 3 / 6])
    assert s["accepted_length_histogram"] == [1, 1, 1, 3]
    assert s["spec_tokens_per_s"] == pytest.approx(30 / 5.0)
    assert s["target_tokens_per_s"] == pytest.approx(30 / 10.0)
    assert s["speedup"] == pytest.approx(2.0)  # prefills included
    # after the prefills: 6 cycles in 5 - 2 s; 28 plain steps (each token after a prefill's) in 10 - 1 s
    assert s["cycle_plain_steps"] == pytest.approx((3.0 / 6) / (9.0 / 28))
    assert s["spec_prefill_seconds"] == pytest.approx(2.0) and s["target_prefill_seconds"] == pytest.approx(1.0)
    assert s["num_prompts"] == 2 and s["identical_outputs"] == 1
    assert s["per_prompt"] == [[10, 3], [8, 3]]  # emitted, steps: pooled, they give the set's tau
    assert sum(e for e, _ in s["per_prompt"]) / sum(n for _, n in s["per_prompt"]) == pytest.approx(s["tau"])


def test_plots_and_table(tmp_path):
    a = acceptance_stats([0, 3, 1, 3, 2], 4)
    b = acceptance_stats([1, 1, 0], 4)
    extra = {"num_prompts": 1, "spec_tokens": 14, "spec_tokens_per_s": 7.0, "target_tokens_per_s": 3.5,
             "speedup": 2.0, "identical_outputs": 1}
    sets = {"assistant": {**a, **extra}, "chitchat": {**b, **extra}}
    paths = plot(sets, tmp_path)
    assert [p.name for p in paths] == [PER_POSITION_PNG, HISTOGRAM_PNG]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    table = summary_table(sets)
    assert "assistant" in table and "chitchat" in table and "2.80" in table and "2.00x" in table


def test_lossless_note_warns_only_when_greedy_outputs_differ():
    from dflash_train.eval.report import lossless_note

    same = {"num_prompts": 4, "identical_outputs": 4}
    differ = {"num_prompts": 4, "identical_outputs": 1}
    assert lossless_note(same, float32=True, temperature=0.0) is None
    assert lossless_note(differ, float32=False, temperature=0.7) is None  # sampling: no reference
    assert "3 of 4" in lossless_note(differ, float32=True, temperature=0.0)
    assert "near-tie" in lossless_note(differ, float32=False, temperature=0.0)
    assert "reduced precision" in lossless_note(differ, float32=False, temperature=0.0)


def test_a_prompt_timed_during_a_stall_is_named_and_the_others_are_not():
    """A cycle's cost is the machine's, so one prompt whose cycle is 2x off the set's median (here a 12-s stall
    inside its speculative decode, or inside its plain decode) is named in the report and in a printed note;
    a set whose cycles agree, or one too small to have a median, gets neither."""
    from dflash_train.eval.report import cycle_outliers, timing_note

    def pair(spec_s: float, plain_s: float):  # 10 cycles of 2 tokens; 19 plain steps after a 0.1-s prefill
        return (SpecResult([1] * 20, [1] * 10, 4, spec_s, False, prefill_seconds=0.1),
                GenResult([1] * 20, plain_s, False, 0.1))

    calm = [pair(1.1 + 0.1 * i, 1.5 + 0.05 * i) for i in range(5)]  # cycles ~1.3-1.4 plain steps each
    assert cycle_outliers(*zip(*calm)) == [] and timing_note(summarize(*zip(*calm), block_size=4)) is None
    for stalled in (pair(13.2, 1.6), pair(1.2, 13.6)):  # a stall in the speculative / the plain decode
        runs = calm[:2] + [stalled] + calm[2:]
        found = cycle_outliers(*zip(*runs))
        assert [o["prompt"] for o in found] == [2]
        assert found[0]["median_cycle_plain_steps"] == pytest.approx(statistics.median(
            (s.seconds - 0.1) / 10 / ((p.seconds - 0.1) / 19) for s, p in runs))  # 6 prompts: the middle two's mean
        note = timing_note(summarize(*zip(*runs), block_size=4))
        assert "prompt 2:" in note and "rerun" in note
    assert cycle_outliers(*zip(*[calm[0], pair(13.2, 1.6)])) == []  # 2 prompts: no median to judge by
