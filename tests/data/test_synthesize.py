"""Self-written prompts: the pre-query prefix on several chat templates, the refusals, filters and
de-duplication against hand-made lists, seeded reproducibility and resume (tiny random Qwen3),
the `data.train` spec, and one small real check on SmolLM2."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections import Counter

import pytest

from dflash_train.config import DataConfig
from dflash_train.data.dataset import parse_train_spec, read_train_conversations
from dflash_train.data.regenerate import end_of_turn_ids
from dflash_train.data.synthesize import (NoUserTurnError, Selector, SynthSettings, batch_seed, pre_query_prefix,
                                          sample_batch, synthesize_prompts, synthesized_eval_prompts)
from dflash_train.model.target.target import Target
from dflash_train.eval.prompt_sets import SetContext, load_prompt_sets
from tests.conftest import tiny_qwen3

LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN_DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by "
                       "Alibaba Cloud. You are a helpful assistant.<|im_end|>\n{% endif %}"
                       "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                       "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
         "supported') }}{% endif %}{% for m in messages %}{% if m['role'] == 'assistant' %}{% set role = 'model' %}"
         "{% else %}{% set role = m['role'] %}{% endif %}<start_of_turn>{{ role }}\n{{ m['content'] | trim }}"
         "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
NO_USER_CONTENT = "{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>{% endfor %}"


def _with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def _settings(**changes) -> SynthSettings:
    base = SynthSettings.from_config(DataConfig())
    return dataclasses.replace(base, **changes)


# ---------------------------------------------------------------------------------------------
# The pre-query prefix


def test_prefix_smollm2_chatml_with_its_default_system_turn(smollm2_tokenizer):
    expected = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\n")
    assert pre_query_prefix(smollm2_tokenizer) == expected


@pytest.mark.parametrize("template,expected", [
    (LLAMA3, "{bos}<|start_header_id|>user<|end_header_id|>\n\n"),
    (QWEN_DEFAULT_SYSTEM, "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                          "assistant.<|im_end|>\n<|im_start|>user\n"),
    (GEMMA, "{bos}<start_of_turn>user\n"),
], ids=["llama3", "qwen-default-system", "gemma"])
def test_prefix_is_the_template_up_to_the_user_content(smollm2_tokenizer, template, expected):
    tok = _with_template(smollm2_tokenizer, template)
    prefix = pre_query_prefix(tok)
    assert prefix == expected.format(bos=tok.bos_token)
    rendered = tok.apply_chat_template([{"role": "user", "content": "How do I sort a list?"}], tokenize=False)
    assert rendered.startswith(prefix + "How do I sort a list?")


def test_refuses_a_tokenizer_without_chat_template(smollm2_tokenizer):
    with pytest.raises(NoUserTurnError, match="no chat template") as err:
        pre_query_prefix(_with_template(smollm2_tokenizer, None))
    assert "base model" in str(err.value) and "text continuation" in str(err.value)


def test_refuses_a_template_without_user_content(smollm2_tokenizer):
    with pytest.raises(NoUserTurnError, match="has no user turn"):
        pre_query_prefix(_with_template(smollm2_tokenizer, NO_USER_CONTENT))


def test_refuses_a_template_that_raises(smollm2_tokenizer):
    with pytest.raises(NoUserTurnError, match="failed on a single user turn"):
        pre_query_prefix(_with_template(smollm2_tokenizer, "{{ raise_exception('no users here') }}"))


# ---------------------------------------------------------------------------------------------
# Filters and de-duplication


def test_filters_and_dedupe_against_a_hand_made_list():
    outputs = [
        ("How do I bake sourdough bread at home?", True),                     # kept
        ("   ", True),                                                        # empty
        ("", False),                                                          # empty (before not-ended)
        ("Write a poem about the sea and the", False),                        # did_not_end_turn
        ("Hi there", True),                                                   # too_short (2 words < 3)
        (" ".join(["word"] * 12), True),                                      # too_long (12 > 10)
        ("how do I bake SOURDOUGH bread at home", True),                      # exact_duplicate (normalized)
        ("How do I bake sourdough bread at home quickly?", True),             # near_duplicate (J = 6/7)
        ("What is the capital of France?", True),                             # excluded
        ("Explain recursion to a child.", True),                              # kept
        ("Give me three tips for a job interview.", True),                    # kept
    ]
    selector = Selector(10, _settings(min_words=3, max_words=10, near_dup_jaccard=0.6),
                        exclude=["what is the capital of france"])
    selector.feed({"text": t, "ended": e} for t, e in outputs)
    assert selector.kept == ["How do I bake sourdough bread at home?", "Explain recursion to a child.",
                             "Give me three tips for a job interview."]
    assert selector.dropped == Counter(empty=2, did_not_end_turn=1, too_short=1, too_long=1, exact_duplicate=1,
                                       near_duplicate=1, excluded=1)


def test_near_duplicate_threshold_is_jaccard_of_word_trigrams():
    # 8 words -> 6 trigrams each; one changed last word: 5 shared of 7 distinct, J = 0.714
    a = "please tell me a story about a dragon"
    b = "please tell me a story about a knight"
    for threshold, kept in ((0.7, [a]), (0.72, [a, b])):
        selector = Selector(5, _settings(near_dup_jaccard=threshold))
        selector.feed([{"text": a, "ended": True}, {"text": b, "ended": True}])
        assert selector.kept == kept


def test_selector_stops_at_n_and_leaves_the_rest_unused():
    selector = Selector(2, _settings())
    selector.feed({"text": f"question number {w} about things", "ended": True} for w in ("one", "two", "three"))
    assert selector.kept == ["question number one about things", "question number two about things"]
    assert not selector.dropped


# ---------------------------------------------------------------------------------------------
# Sampling mechanics on a tiny random Qwen3


@pytest.fixture(scope="module")
def ending_target(smollm2_tokenizer):
    """A tiny random Qwen3 whose generation is forced to end its turn at max_new_tokens (random
    weights never choose the end-of-turn token, and the mechanics need kept prompts)."""
    model = tiny_qwen3(len(smollm2_tokenizer), layers=2)
    model.generation_config.eos_token_id = smollm2_tokenizer.eos_token_id
    model.generation_config.forced_eos_token_id = smollm2_tokenizer.eos_token_id
    return Target(model=model, tokenizer=smollm2_tokenizer, name="tiny-qwen3-ending")


TINY = dict(max_new_tokens=8, batch_size=4, min_words=1, max_words=50)


class Interrupted(Exception):
    pass


def test_seeded_reproducible_and_resumable(ending_target, tmp_path):
    settings = _settings(**TINY)
    full, report = synthesize_prompts(ending_target, 10, seed=3, cache_path=tmp_path / "a.jsonl", settings=settings)
    assert len(full) == 10 and report.kept == 10 and report.batches >= 3
    assert sum(report.dropped.values()) + report.kept <= report.sampled

    again, _ = synthesize_prompts(ending_target, 10, seed=3, settings=settings)  # no cache: same seeds
    assert again == full

    def stop_after_two(b):
        if b == 1:
            raise Interrupted

    cache = tmp_path / "b.jsonl"
    with pytest.raises(Interrupted):
        synthesize_prompts(ending_target, 10, seed=3, cache_path=cache, settings=settings, on_batch=stop_after_two)
    assert len(cache.read_text().splitlines()) == 1 + 2  # header + the two completed batches
    resumed, report = synthesize_prompts(ending_target, 10, seed=3, cache_path=cache, settings=settings)
    assert resumed == full and report.cached_batches == 2

    more, report = synthesize_prompts(ending_target, 14, seed=3, cache_path=cache, settings=settings)
    assert more[:10] == full and report.cached_batches >= 3

    other, _ = synthesize_prompts(ending_target, 10, seed=4, settings=settings)
    assert other != full


def test_eval_stream_is_disjoint_from_training(ending_target):
    settings = _settings(**TINY)
    train, _ = synthesize_prompts(ending_target, 8, seed=0, settings=settings)
    held_out = synthesized_eval_prompts(ending_target, 8, seed=0, settings=settings)
    assert all(m[-1]["role"] == "user" for m in held_out)
    assert not set(train) & {m[-1]["content"] for m in held_out}
    assert {batch_seed("train", 0, b) for b in range(100)}.isdisjoint(batch_seed("eval", 0, b) for b in range(100))


def test_synthesized_prompt_set_is_the_held_out_stream_cached_beside_the_run(ending_target, tmp_path):
    data = dataclasses.replace(DataConfig(), synth_max_new_tokens=8, synth_batch_size=4, synth_min_words=1,
                               synth_max_words=50)
    context = SetContext(target=ending_target, data=data, seed=0, cache_dir=tmp_path / "data")
    sets = load_prompt_sets("synthesized,assistant", 5, context)
    expected = synthesized_eval_prompts(ending_target, 5, seed=0, settings=SynthSettings.from_config(data))
    assert list(sets) == ["synthesized", "assistant"] and sets["synthesized"] == expected
    assert len(list((tmp_path / "data").glob("synthesized-eval-*.jsonl"))) == 1
    assert load_prompt_sets("synthesized", 3, context)["synthesized"] == expected[:3]  # read from the cache
    with pytest.raises(ValueError, match="needs a loaded target"):
        load_prompt_sets("synthesized", 3)


def test_cache_from_other_settings_is_refused(ending_target, tmp_path):
    cache = tmp_path / "c.jsonl"
    synthesize_prompts(ending_target, 4, seed=0, cache_path=cache, settings=_settings(**TINY))
    with pytest.raises(ValueError, match="other settings"):
        synthesize_prompts(ending_target, 4, seed=0, cache_path=cache, settings=_settings(**TINY, top_p=0.5))


def test_gives_up_with_drop_counts_when_nothing_ends_its_turn(tiny_qwen3_target):
    with pytest.raises(RuntimeError, match="did_not_end_turn"):
        synthesize_prompts(tiny_qwen3_target, 2, seed=0, settings=_settings(**TINY))


# ---------------------------------------------------------------------------------------------
# The data.train spec


def test_spec_single_sources_and_mixes(tmp_path):
    path = tmp_path / "a,b:1.jsonl"
    path.write_text("")
    assert parse_train_spec("default", None) == [("default", None)]
    assert parse_train_spec(str(path), 7) == [(str(path), 7)]
    assert parse_train_spec("synthesize", 50) == [("synthesize", 50)]
    assert parse_train_spec("default:0.5,synthesize:0.5", 101) == [("default", 51), ("synthesize", 50)]
    assert parse_train_spec("default, chitchat:2, synthesize", 10) == [("default", 3), ("chitchat", 5),
                                                                       ("synthesize", 2)]


@pytest.mark.parametrize("spec,max_samples,match", [
    ("synthesize", None, "needs data.max_samples"),
    ("default,chitchat", None, "needs data.max_samples"),
    ("defualt", 10, "not a named source"),
    ("default:0,synthesize", 10, "must be > 0"),
    ("default,default:2", 10, "appears twice"),
])
def test_spec_errors(spec, max_samples, match):
    with pytest.raises(ValueError, match=match):
        parse_train_spec(spec, max_samples)


def test_mixed_source_reads_each_share(ending_target, tmp_path):
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("".join(json.dumps({"id": f"m{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                             for i in range(10)))
    cfg = dataclasses.replace(DataConfig(), train=f"{jsonl}:1,synthesize:1", max_samples=6,
                              **{f"synth_{k}": v for k, v in TINY.items()})
    convs, bad = read_train_conversations(cfg, ending_target, "tiny", tmp_path, seed=0, log=lambda _: None)
    ids = sorted(c.id for c in convs)
    assert ids == ["m0", "m1", "m2", "synth-000000", "synth-000001", "synth-000002"] and not bad.total
    assert list(tmp_path.glob("synthesized-*.jsonl"))


# ---------------------------------------------------------------------------------------------
# A small real check


@pytest.mark.slow
def test_smollm2_writes_requests_that_end_their_turn(smollm2_target):
    """One batch of 8 from the real instruct target: most outputs end their turn and are non-empty,
    and they differ (sampled, not one repeated prompt)."""
    settings = _settings(batch_size=8, max_new_tokens=64)
    prefix_ids = smollm2_target.tokenizer(pre_query_prefix(smollm2_target.tokenizer), add_special_tokens=False)
    outputs = sample_batch(smollm2_target, prefix_ids["input_ids"], settings, end_of_turn_ids(smollm2_target),
                           batch_seed("train", 0, 0))
    usable = [o for o in outputs if o["ended"] and o["text"].strip()]
    assert len(usable) >= 5, outputs
    assert len({o["text"] for o in usable}) == len(usable)
    selector = Selector(8, settings)
    selector.feed(outputs)
    assert len(selector.kept) + sum(selector.dropped.values()) == 8 and len(selector.kept) >= 4


@pytest.mark.slow
def test_the_fixed_shape_sampler_writes_seeded_prompts(smollm2_target):
    """The GPU's sampler (data/graph_decode.py, run here eagerly): seeded batches of rows shaped as
    HF generate's, some ending their turn."""
    from dflash_train.data.graph_decode import GraphDecoder

    settings = _settings(batch_size=4, max_new_tokens=24)
    stop_ids = end_of_turn_ids(smollm2_target)
    prefix_ids = smollm2_target.tokenizer(pre_query_prefix(smollm2_target.tokenizer),
                                          add_special_tokens=False)["input_ids"]
    sampler = GraphDecoder(smollm2_target.model, lambda hidden: {}, settings.batch_size, stop_ids, stop_ids[0],
                           use_graph=False, sampling=(settings.temperature, settings.top_p))
    first, again = (sample_batch(smollm2_target, prefix_ids, settings, stop_ids, 7, sampler) for _ in range(2))
    assert first == again and len(first) == 4
    assert all(set(o) == {"text", "ended", "new_tokens"} and o["new_tokens"] <= 24 for o in first)
    assert any(o["ended"] for o in first) and len({o["text"] for o in first}) > 1
