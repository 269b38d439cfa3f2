"""regenerate: prompts up to the last user turn, greedy batched generation with left padding, and
a resume after an interruption or a torn last line yields every id exactly once."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train.data.records import Conversation
from dflash_train.data.conversations import prompt_messages
from dflash_train.data.regenerate import read_done_ids, regenerate


def _conversations(n: int) -> list[Conversation]:
    convs = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Question number {i}: " + "tell me more " * (i % 4)}]
        if i % 3 == 0:  # a final assistant turn is dropped and regenerated
            msgs += [{"role": "assistant", "content": "old answer"}]
        if i % 5 == 0:
            msgs = [{"role": "system", "content": "Be brief."}] + msgs
        convs.append(Conversation(f"c{i}", msgs))
    return convs


class Interrupt(Exception):
    pass


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prompt_is_everything_up_to_the_last_user_turn():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert prompt_messages(msgs) == msgs[:3]
    assert prompt_messages(msgs[:3]) == msgs[:3]


def test_interrupted_and_torn_runs_resume_with_each_id_once(tmp_path, tiny_qwen3_target):
    convs, out = _conversations(10), tmp_path / "regen.jsonl"

    def stop_after_first_batch(batch_index):
        raise Interrupt

    with pytest.raises(Interrupt):
        regenerate(tiny_qwen3_target, convs, out, max_new_tokens=4, batch_size=3, on_batch=stop_after_first_batch)
    assert len(_rows(out)) == 3
    with open(out, "a") as f:  # a crash in the middle of writing the next line
        f.write('{"id": "c9", "messages": [{"role": "us')
    assert len(read_done_ids(out)) == 3 and out.read_text().endswith("}\n")  # torn line cut away
    with open(out, "a") as f:
        f.write('{"id": "c9", "mess')
    report = regenerate(tiny_qwen3_target, convs, out, max_new_tokens=4, batch_size=3)
    assert (report.already_done, report.written) == (3, 7)
    rows = _rows(out)
    assert sorted(r["id"] for r in rows) == sorted(c.id for c in convs)
    by_id = {r["id"]: r for r in rows}
    for conv in convs:
        row = by_id[conv.id]
        assert row["messages"][:-1] == prompt_messages(conv.messages)
        assert row["messages"][-1]["role"] == "assistant" and row["finish_reason"] in ("stop", "length")
    assert regenerate(tiny_qwen3_target, convs, out, 4, 3).written == 0  # nothing left to do


def test_batched_left_padded_greedy_equals_one_by_one(tmp_path, tiny_qwen3_target):
    convs = _conversations(4)
    regenerate(tiny_qwen3_target, convs, tmp_path / "batched.jsonl", max_new_tokens=6, batch_size=4)
    regenerate(tiny_qwen3_target, convs, tmp_path / "single.jsonl", max_new_tokens=6, batch_size=1)
    batched = {r["id"]: r for r in _rows(tmp_path / "batched.jsonl")}
    single = {r["id"]: r for r in _rows(tmp_path / "single.jsonl")}
    assert batched == single


def test_sampling_is_seeded(tmp_path, tiny_qwen3_target):
    convs = _conversations(3)
    outs = []
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        regenerate(tiny_qwen3_target, convs, tmp_path / f"{name}.jsonl", 8, 3, temperature=1.0, seed=seed)
        outs.append({r["id"]: r["messages"][-1]["content"] for r in _rows(tmp_path / f"{name}.jsonl")})
    assert outs[0] == outs[1] and outs[0] != outs[2]
    before = torch.random.get_rng_state()
    regenerate(tiny_qwen3_target, convs, tmp_path / "d.jsonl", 2, 3, temperature=1.0)
    assert torch.equal(before, torch.random.get_rng_state())  # the caller's RNG is untouched


def test_duplicate_ids_are_refused(tmp_path, tiny_qwen3_target):
    convs = _conversations(2) + [Conversation("c0", [{"role": "user", "content": "again"}])]
    with pytest.raises(ValueError, match="duplicate conversation ids"):
        regenerate(tiny_qwen3_target, convs, tmp_path / "x.jsonl", 2, 2)
