"""The embedded default corpus: deterministic seeded mix, held-out eval sets disjoint from
training, and the eval file shipped as package data."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from dflash_train.data import corpus
from dflash_train.data.assistant_templates import assistant_training_prompts, topic_phrases

REPO = Path(__file__).resolve().parents[2]


def test_assistant_training_prompts_are_a_few_thousand_distinct():
    prompts = assistant_training_prompts()
    assert 3000 <= len(prompts) == len(set(prompts))
    assert prompts == assistant_training_prompts()  # deterministic


def test_default_train_mix_is_seeded_half_half_and_prompt_only():
    a = corpus.default_train_conversations(seed=0, max_samples=200)
    assert [c.id for c in a] == [c.id for c in corpus.default_train_conversations(seed=0, max_samples=200)]
    assert [c.id for c in a] != [c.id for c in corpus.default_train_conversations(seed=1, max_samples=200)]
    assert sum(c.id.startswith("assistant-") for c in a) == sum(c.id.startswith("chitchat-") for c in a) == 100
    assert all(len(c.messages) == 1 and c.messages[0]["role"] == "user" for c in a)
    full = corpus.default_train_conversations(seed=0)
    assert len(full) == 2 * len(assistant_training_prompts()) and len({c.id for c in full}) == len(full)


def test_eval_prompts_are_held_out_and_end_with_a_user_turn():
    sets = {"assistant": corpus.assistant_eval_prompts(), "chitchat": corpus.chitchat_eval_prompts()}
    assert len(sets["assistant"]) >= 60 and len(sets["chitchat"]) == 60
    for messages in sets["assistant"] + sets["chitchat"]:
        assert messages[-1]["role"] == "user" and messages[-1]["content"].strip()
    train_texts = {" ".join(c.messages[0]["content"].lower().split())
                   for c in corpus.default_train_conversations(seed=0)}
    eval_texts = [" ".join(m[-1]["content"].lower().split()) for ms in sets.values() for m in ms]
    assert not train_texts & set(eval_texts)
    heldout_chitchat = {c.messages[0]["content"] for c in corpus.chitchat_conversations("eval")}
    assert all(m[-1]["content"] in heldout_chitchat for m in sets["chitchat"])


def test_hand_written_eval_requests_share_no_training_topic():
    """Independence of the hand-written set: no multi-word (or long) training topic occurs in it."""
    phrases = {re.sub(r"^(a|an|the) ", "", p.lower()).rstrip(".") for p in topic_phrases()}
    distinctive = [p for p in phrases if len(p.split()) >= 2 or len(p) >= 9]
    for messages in corpus.assistant_eval_prompts():
        text = messages[-1]["content"].lower()
        hits = [p for p in distinctive if re.search(rf"\b{re.escape(p)}\b", text)]
        assert not hits, (text, hits)


def test_chitchat_split_is_disjoint_and_turns_alternate():
    train, held = corpus.chitchat_conversations("train"), corpus.chitchat_conversations("eval")
    assert 100 < len(held) < 300 and len(train) + len(held) > 7000
    assert not {c.id for c in train} & {c.id for c in held}
    for conv in train[:500]:
        roles = [m["role"] for m in conv.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2)


def test_eval_file_is_package_data():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    assert "assistant_eval_prompts.jsonl" in data["dflash_train.data"]
    assert corpus.EVAL_PROMPTS_FILE.is_file()
