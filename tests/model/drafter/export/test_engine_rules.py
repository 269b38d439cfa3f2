"""One test per engine rule of model/drafter/export/engine_rules.py, each rule citing the engine file and function it
mirrors (vLLM 0.34.0 / main 00746147, SGLang 0.5.23, read from their code): a key an engine reads is
found where it reads it with the trained value, or named; a key an engine refuses is named with it.
The configs are the exports of each head (`zlab_config_dict` of a real DrafterConfig per architecture,
the one that lists the key; with a reduced draft vocabulary where the head's engines serve one), broken one
rule at a time."""

import copy
import dataclasses

import pytest
import torch
from transformers import Qwen3Config

from dflash_train.model.drafter.heads.architectures import HEADS, head
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.export.engine_rules import MISSING, READS, REFUSALS, expected_keys
from dflash_train.model.drafter.export.hf_format import zlab_config_dict
from dflash_train.model.drafter.export.check import check_placement

TARGET = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=256)


DRAFT_VOCAB = 100


def _exported(arch: str):
    """(config, its config.json, the rows of its reduced draft vocabulary or None)."""
    cfg = drafter_config_from_target(TARGET, num_layers=1, block_size=4, mask_token_id=7, num_taps=2, arch=arch)
    cfg = dataclasses.replace(cfg, selector_rank=8, selector_top_k=4, markov_rank=8)
    rows = DRAFT_VOCAB if head(arch).export.reduced_vocab.exported else None
    return cfg, zlab_config_dict(cfg, draft_vocab=None if rows is None else torch.arange(rows)), rows


def _head_with(key: str) -> str:
    """The first head whose export carries `key` (every head carries the mask and the taps)."""
    return next(name for name, h in HEADS.items() if key in expected_keys(h.export, *_exported(name)[::2]))


def _delete(d: dict, path: str) -> None:
    section, _, name = path.rpartition(".")
    ((d.get(section) or {}) if section else d).pop(name, None)


def _put(d: dict, path: str, value) -> None:
    section, _, name = path.rpartition(".")
    (d.setdefault(section, {}) if section else d)[name] = value


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, list):
        return [v + 1 for v in value]
    return "rnn" if value != "rnn" else "gated"


def test_every_head_exports_where_both_engines_read():
    for arch in HEADS:
        cfg, d, rows = _exported(arch)
        assert check_placement(d, cfg, rows) == [], arch


@pytest.mark.parametrize("rule", READS, ids=lambda r: f"{r.engine}-{r.key}-{r.mirrors.split()[0]}")
def test_a_key_missing_where_the_engine_reads_it(rule):
    assert rule.mirrors.startswith(("vllm/", "python/sglang/"))  # the engine file it mirrors
    cfg, d, rows = _exported(_head_with(rule.key))
    want = expected_keys(head(cfg.arch).export, cfg, rows)[rule.key]
    for place in rule.places:
        _delete(d, place.path)
    found = {f.field: f for f in check_placement(d, cfg, rows)}
    first = rule.places[0].path
    if rule.default is MISSING:  # the engine raises at load
        assert rule.engine in found[first].refused_by and rule.mirrors in found[first].message
    elif rule.default != want:  # it loads and uses its default: served wrong, said
        assert f"{rule.engine} reads it from" in found[first].message and "would use" in found[first].message
    else:  # its default is what was trained: nothing to say about this engine
        assert first not in found or rule.engine not in found[first].message


@pytest.mark.parametrize("rule", READS, ids=lambda r: f"{r.engine}-{r.key}-{r.mirrors.split()[0]}")
def test_a_wrong_value_where_the_engine_reads_first(rule):
    cfg, d, rows = _exported(_head_with(rule.key))
    want = expected_keys(head(cfg.arch).export, cfg, rows)[rule.key]
    first = rule.places[0]
    _put(d, first.path, [v + first.plus for v in _other(want)] if isinstance(want, list) else _other(want))
    found = {f.field: f for f in check_placement(d, cfg, rows)}
    assert f"{rule.engine} reads" in found[first.path].message and rule.mirrors in found[first.path].message


@pytest.mark.parametrize("rule", REFUSALS, ids=lambda r: f"{r.engine}-{r.place.path}-{r.mirrors.split()[0]}")
def test_a_key_the_engine_refuses(rule):
    assert rule.mirrors.startswith(("vllm/", "python/sglang/"))
    for arch in HEADS:  # whatever the head
        cfg, d, rows = _exported(arch)
        d = copy.deepcopy(d)
        _put(d, rule.place.path, True)
        found = {f.field: f for f in check_placement(d, cfg, rows)}
        assert rule.engine in found[rule.place.path].refused_by and rule.why in found[rule.place.path].message
