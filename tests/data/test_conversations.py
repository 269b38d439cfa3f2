"""Reading conversations (JSONL ShareGPT/OpenAI, HF datasets, parquet), row errors, and the
assistant-only loss mask checked by decoding the masked tokens."""

from __future__ import annotations

import json

import pytest

from dflash_train.data.conversations import read_conversations, tokenize_conversation, tokenize_conversations
from dflash_train.data.records import Conversation
from dflash_train.data.rows import DataError

END = "<|im_end|>"
SHAREGPT = {"id": "sg-1", "conversations": [
    {"from": "system", "value": "You are terse."},
    {"from": "human", "value": "What is 2+2?"},
    {"from": "gpt", "value": "4, of course."},
    {"from": "human", "value": "And the assistant said?"},
    {"from": "gpt", "value": "That the assistant is me.\nTwo lines."}]}
OPENAI = {"messages": [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue"},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": " Green, with a leading space"}]}


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def masked_segments(tokenizer, ids, mask) -> list[str]:
    """Decode each maximal run of supervised tokens."""
    segments, run = [], []
    for tok, m in zip(ids + [None], mask + [0]):
        if m:
            run.append(tok)
        elif run:
            segments.append(tokenizer.decode(run))
            run = []
    return segments


def assistant_texts(messages) -> list[str]:
    return [m["content"] + END for m in messages if m["role"] == "assistant"]


def test_sharegpt_and_openai_rows_mask_exactly_the_assistant_turns(tmp_path, smollm2_tokenizer):
    convs, bad = read_conversations(str(_write_jsonl(tmp_path / "d.jsonl", [SHAREGPT, OPENAI])))
    assert bad.total == 0 and convs[0].id == "sg-1" and convs[1].id.startswith("L2-")
    assert convs[0].messages[0] == {"role": "system", "content": "You are terse."}
    for conv in convs:
        ids, mask = tokenize_conversation(smollm2_tokenizer, conv.messages, max_len=4096)
        assert len(ids) == len(mask)
        assert masked_segments(smollm2_tokenizer, ids, mask) == assistant_texts(conv.messages)
        unmasked = smollm2_tokenizer.decode([t for t, m in zip(ids, mask) if not m])
        assert "<|im_start|>assistant\n" in unmasked
        assert all(m["content"] in unmasked for m in conv.messages if m["role"] != "assistant")


def test_chitchat_conversations_mask_exactly_the_assistant_turns(smollm2_tokenizer):
    from dflash_train.data.corpus import chitchat_conversations

    multi_turn = [c for c in chitchat_conversations("train") if len(c.messages) >= 4][:5]
    assert len(multi_turn) == 5
    for conv in multi_turn:
        ids, mask = tokenize_conversation(smollm2_tokenizer, conv.messages, max_len=100_000)
        assert masked_segments(smollm2_tokenizer, ids, mask) == assistant_texts(conv.messages)


QWEN3_LIKE_TEMPLATE = (  # re-renders history like Qwen3: only the final answer gets a think block
    "{%- for m in messages %}{%- if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if loop.last %}<think>\n\n</think>\n\n{%- endif %}{{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}")


def test_template_that_rerenders_history_still_masks_only_content(smollm2_tokenizer):
    tok = smollm2_tokenizer
    saved = tok.chat_template
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    try:
        ids, mask = tokenize_conversation(tok, OPENAI["messages"], max_len=4096, thinking=False)
    finally:
        tok.chat_template = saved
    assert "<think>" in tok.decode(ids)  # the boilerplate is there, and unsupervised
    assert masked_segments(tok, ids, mask) == assistant_texts(OPENAI["messages"])


def test_truncation_and_min_loss_tokens_are_counted(smollm2_tokenizer):
    full_ids, full_mask = tokenize_conversation(smollm2_tokenizer, OPENAI["messages"], max_len=4096)
    ids, mask = tokenize_conversation(smollm2_tokenizer, OPENAI["messages"], max_len=20)
    assert (ids, mask) == (full_ids[:20], full_mask[:20])
    convs = [Conversation("long", OPENAI["messages"]), Conversation("prompt-only", OPENAI["messages"][:1])]
    samples, bad = tokenize_conversations(smollm2_tokenizer, convs, max_len=4096, min_loss_tokens=2)
    assert [s.id for s in samples] == ["long"] and dict(bad.counts) == {"too_few_loss_tokens": 1}
    assert "too_few_loss_tokens 1" in bad.summary()


BAD_ROWS = [
    ('{"conversations": [', "bad_json", "d.jsonl:2: bad JSON"),
    ({"id": "x"}, "missing_field", "d.jsonl:3: field 'conversations': missing"),
    ({"conversations": []}, "empty_conversation", "d.jsonl:4: field 'conversations': empty conversation"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "role_order",
     "d.jsonl:5: field 'messages[0].role': wrong role order: expected user, got assistant"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}, {"from": "human", "value": 3}]},
     "non_string_content", "d.jsonl:6: field 'conversations[2].value': expected a string, got int"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "role_order",
     "d.jsonl:7: field 'messages[1].role': wrong role order: expected assistant, got user"),
    ({"messages": [{"role": "robot", "content": "a"}]}, "unknown_role", "d.jsonl:8: field 'messages[0].role': unknown role"),
    ({"conversations": [{"from": "human"}]}, "missing_field", "d.jsonl:9: field 'conversations[0].value': missing"),
]


@pytest.mark.parametrize("row,reason,message", BAD_ROWS, ids=[f"line{i + 2}-{r[1]}" for i, r in enumerate(BAD_ROWS)])
def test_each_malformed_row_raises_with_file_line_and_field(tmp_path, row, reason, message):
    line = int(message.split(":")[1])
    rows = [OPENAI] + [OPENAI] * (line - 2) + [row]  # the bad row sits at its documented line
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=f"^{message.replace('[', '.').replace(']', '.').replace('+', '.')}") as e:
        read_conversations(str(path))
    assert e.value.reason == reason


def test_a_bad_row_names_the_setting_that_skips_it(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [OPENAI, '{"conversations": ['])
    with pytest.raises(DataError, match=r"d.jsonl:2: bad JSON.*data.skip_bad_rows=true"):
        read_conversations(str(path))


def test_skip_bad_rows_counts_every_reason(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [OPENAI] + [r[0] for r in BAD_ROWS] + [SHAREGPT])
    convs, bad = read_conversations(str(path), skip_bad_rows=True)
    assert convs[0].id.startswith("L1-") and convs[1].id == "sg-1"  # no id field: line and content, not the name
    assert dict(bad.counts) == {"bad_json": 1, "missing_field": 2, "empty_conversation": 1, "role_order": 2,
                                "non_string_content": 1, "unknown_role": 1}
    assert bad.total == len(BAD_ROWS) and bad.examples[0].startswith("d.jsonl:2: bad JSON")
    assert bad.summary().startswith("skipped rows: 8 (bad_json 1, empty_conversation 1, missing_field 2")


def test_hf_dataset_and_parquet_follow_the_same_rules(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"id": "a", "messages": OPENAI["messages"]}, {"id": "b", "messages": OPENAI["messages"][:3]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    for spec in (tmp_path / "ds", tmp_path / "d.parquet"):
        convs, bad = read_conversations(str(spec))
        assert [c.id for c in convs] == ["a", "b"] and convs[0].messages == OPENAI["messages"]
    bad_rows = [{"id": "a", "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}]
    datasets.Dataset.from_list(bad_rows).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match=r"^bad.parquet:1: field 'messages\[1\].role'"):
        read_conversations(str(tmp_path / "bad.parquet"))


THINKING_TEMPLATE = (  # Qwen3's shape: thinking off writes an empty think block into every assistant turn
    "{% set off = enable_thinking is defined and not enable_thinking %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and off %}"
    "<think>\n\n</think>\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if off %}<think>\n\n</think>\n{% endif %}{% endif %}")


@pytest.mark.parametrize("thinking", [None, True, False])
def test_pitfall_5_one_template_and_thinking_mode_in_regeneration_training_eval_and_export(
        smollm2_tokenizer, thinking, tmp_path):
    """Published pitfall 5 (z-lab #133): the same template and thinking mode everywhere. A template
    that reads `enable_thinking`: the prompt regeneration feeds the target, the prompt part of a
    training sample and the eval's prompt are the same token ids for each setting (and thinking off
    differs from on, so the setting is really applied); the export records it and the serve
    commands say it."""
    import copy

    import torch

    from dflash_train.data.conversations import chat_record, prompt_messages, render_chat
    from dflash_train.eval.evaluate import encode_prompts
    from dflash_train.model.drafter.export.serve import _requests_note

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = THINKING_TEMPLATE
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    regen = tok(render_chat(tok, prompt_messages(messages), add_generation_prompt=True, thinking=thinking),
                add_special_tokens=False)["input_ids"]  # what data/regenerate.py and regen_taps.py feed
    ids, mask = tokenize_conversation(tok, messages, 256, thinking)
    train_prompt = ids[:list(mask).index(1)]
    (eval_prompt,) = encode_prompts(tok, [messages], thinking, torch.device("cpu"))
    assert regen == list(train_prompt) == eval_prompt[0].tolist()
    off = tok(render_chat(tok, messages[:1], add_generation_prompt=True, thinking=False), add_special_tokens=False)
    on = tok(render_chat(tok, messages[:1], add_generation_prompt=True, thinking=True), add_special_tokens=False)
    assert off["input_ids"] != on["input_ids"]
    record = chat_record(tok, "chat", thinking)
    assert record["thinking"] is thinking and record["thinking_read_by_template"] and record["chat_template_sha256"]
    note = _requests_note(record)
    assert record["chat_template_sha256"] in note
    assert ('"enable_thinking": false' in note) is (thinking is False)


def test_a_line_that_is_not_utf8_is_named_by_file_and_line_and_can_be_skipped(tmp_path):
    """Issue 39: invalid UTF-8 in a JSONL failed without file:line and ignored data.skip_bad_rows."""
    path = tmp_path / "d.jsonl"
    good = json.dumps(OPENAI).encode() + b"\n"
    path.write_bytes(good + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n' + good)
    with pytest.raises(DataError, match=r"d.jsonl:2: not UTF-8: byte 0xe9 at column \d+.*data.skip_bad_rows=true"):
        read_conversations(str(path))
    convs, bad = read_conversations(str(path), skip_bad_rows=True)
    assert len(convs) == 2 and dict(bad.counts) == {"bad_utf8": 1}
