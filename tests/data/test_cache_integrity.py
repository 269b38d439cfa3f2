"""The run's data caches are checked by content on every use (issue 39, defect 4: token ids edited in
the cached samples, or 64 KiB of garbage in the cached taps file, were trained on silently by a fresh
run into the same directory). Real parts: the tiny random Qwen3 over the SmolLM2 tokenizer, real
chit-chat conversations, the real regenerate + tap pass."""

import dataclasses
import json

import pytest
import torch

from dflash_train import cache, recipes
from dflash_train.data.dataset import load_samples, prepare_samples, prepare_tapped

NAME = "tiny-qwen3|float32"


@pytest.fixture(scope="module")
def data_cfg():
    base = recipes.get("tiny").data
    return dataclasses.replace(base, train="chitchat", regenerate=False, max_samples=12, max_len=96,
                               regen_max_new_tokens=8)


def _garbage_in_the_middle(path, n=64 << 10) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(max(0, size // 2 - n // 2))
        f.write(bytes(range(256)) * (min(n, size) // 256))


def test_edited_token_ids_in_the_cached_samples_are_named_and_rebuilt(tiny_qwen3_target, data_cfg, tmp_path):
    log = []
    path = prepare_samples(data_cfg, tiny_qwen3_target, NAME, tmp_path, 0, log.append)
    built = path.read_text()
    rows = [json.loads(line) for line in built.splitlines()]
    rows[0]["input_ids"][3] = (rows[0]["input_ids"][3] + 1) % 1000  # still a valid sample, silently different
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log.clear()
    assert prepare_samples(data_cfg, tiny_qwen3_target, NAME, tmp_path, 0, log.append) == path
    said = "\n".join(log)
    assert path.name in said and "not what was built" in said and "rebuilding" in said
    assert path.read_text() == built  # what training reads is the build, never the edit
    log.clear()
    prepare_samples(data_cfg, tiny_qwen3_target, NAME, tmp_path, 0, log.append)
    assert "using cached samples" in "\n".join(log) and "rebuilding" not in "\n".join(log)


def test_a_cache_without_a_content_record_is_rebuilt_and_said(tiny_qwen3_target, data_cfg, tmp_path):
    path = prepare_samples(data_cfg, tiny_qwen3_target, NAME, tmp_path, 0, lambda line: None)
    cache.record_path_of(path).unlink()  # as an older version left it
    log = []
    prepare_samples(data_cfg, tiny_qwen3_target, NAME, tmp_path, 0, log.append)
    assert "no content record" in "\n".join(log) and cache.record_path_of(path).is_file()


def test_garbage_in_the_cached_taps_file_is_named_and_rebuilt(tiny_qwen3_target, data_cfg, tmp_path):
    cfg = dataclasses.replace(data_cfg, regenerate=True, max_samples=6)
    log = []
    tapped, ((train, train_index), _) = prepare_tapped(cfg, tiny_qwen3_target, NAME, [1, 3], tmp_path, 0, log.append)
    want = [tapped.taps[i].clone() for i in train_index]
    path = next(tmp_path.glob("tapped-*.safetensors"))
    _garbage_in_the_middle(path)
    log.clear()
    tapped2, ((train2, index2), _) = prepare_tapped(cfg, tiny_qwen3_target, NAME, [1, 3], tmp_path, 0, log.append)
    rows2 = [tapped2.rows()[i] for i in index2]
    said = "\n".join(log)
    assert path.name in said and "sha256 differs" in said and "rebuilding" in said
    assert [s.input_ids for s in train2] == [s.input_ids for s in train]
    assert all(torch.equal(row["taps"], w) for row, w in zip(rows2, want))


def test_a_broken_samples_file_and_an_out_of_range_token_are_named_by_file_line_and_field(tmp_path):
    path = tmp_path / "samples.jsonl"
    good = json.dumps({"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]})
    path.write_text(good + "\n" + '{"id": "b", "input_ids": [1, 2' + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: not a tokenized sample .*delete"):
        load_samples(path, 0.1, vocab_size=10)
    path.write_text(good + "\n" + json.dumps({"id": "b", "input_ids": [1, 99], "loss_mask": [0, 1]}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: field input_ids: token id 99 is outside .*\[0, 10\)"):
        load_samples(path, 0.1, vocab_size=10)
