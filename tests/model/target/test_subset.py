"""A target holding only a subset of its weights (a drafter rank's): exactly the asked tensors,
equal to the whole target's, tied embeddings kept tied, sharded checkpoints read by index, and no
forward on what is not there."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.model.target.load import load_target
from dflash_train.model.target.subset import INDEX_FILE, TargetSubset
from tests.conftest import tiny_qwen3


@pytest.fixture(scope="module")
def whole(tiny_qwen3_dir):
    return load_target(str(tiny_qwen3_dir))


def _assert_same_values(part, whole):
    reference = dict(whole.model.named_parameters(remove_duplicate=False))
    for name, param in part.model.named_parameters(remove_duplicate=False):
        if not param.is_meta:
            torch.testing.assert_close(param, reference[name], rtol=0, atol=0, msg=name)


def test_tied_embedding_only_holds_the_one_tensor_and_runs_no_forward(tiny_qwen3_dir, whole, capsys):
    part = load_target(str(tiny_qwen3_dir), subset=TargetSubset())
    assert sorted(part.held_parameters()) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert part.lm_head_weight is part.embed_weight  # still tied: one tensor
    assert (part.hidden_size, part.num_layers, part.vocab_size, part.dtype) == \
           (whole.hidden_size, whole.num_layers, whole.vocab_size, whole.dtype)
    assert len(whole.held_parameters()) == len(list(whole.model.named_parameters(remove_duplicate=False)))
    _assert_same_values(part, whole)
    assert "target: holds 2 of " in capsys.readouterr().out
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="cannot run the target's forward"):
        part.taps(ids, torch.ones_like(ids), [1])


def test_untied_sharded_checkpoint_with_norm_and_last_layers(smollm2_tokenizer, tmp_path):
    model = tiny_qwen3(len(smollm2_tokenizer), seed=3, tie=False)
    model.save_pretrained(tmp_path, max_shard_size="1MB")  # several files and an index
    smollm2_tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / INDEX_FILE).is_file()
    part = load_target(str(tmp_path), subset=TargetSubset(last_layers=2, final_norm=True))
    held = part.held_parameters()
    expected = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{name}" for i in (4, 5) for name, _ in model.model.layers[i].named_parameters()}
    assert set(held) == expected and len(held) == len(expected)
    assert part.lm_head_weight is not part.embed_weight
    _assert_same_values(part, load_target(str(tmp_path)))


def test_a_missing_tensor_names_the_file_and_the_key(tiny_qwen3_dir, tmp_path):
    for path in tiny_qwen3_dir.iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    tensors = load_file(tiny_qwen3_dir / "model.safetensors")
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"lm_head.weight or model.embed_tokens.weight in .*model.safetensors"):
        load_target(str(tmp_path), subset=TargetSubset())
