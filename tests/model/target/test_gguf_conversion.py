"""The GGUF conversion's speed fix (`load._tensor_name_map_built_once`) against transformers' own
conversion: the same weights, gguf's table built once instead of once per submodule, and gguf left as found."""

from __future__ import annotations

import gguf
import pytest
import torch

from dflash_train.model.target import load
from tests.commands.test_check import write_tiny_gguf


@pytest.mark.slow  # two GGUF conversions by transformers (weights only: ~1 s each on two cores)
def test_the_memoised_name_map_converts_the_same_weights_and_builds_its_table_once(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(tmp_path / "tiny-llama.gguf", tokenizer=False)  # the tensors' names are what is mapped
    builds = []
    real = gguf.get_tensor_name_map

    def counted(*args):
        builds.append(args)
        return real(*args)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counted)

    def convert():
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
        return model.state_dict()

    reference = convert()
    plain_builds, builds[:] = len(builds), []
    with load._tensor_name_map_built_once():
        memoised = convert()
    assert plain_builds > 1 and len(builds) == 1, (plain_builds, builds)
    assert gguf.get_tensor_name_map is counted  # restored on the way out
    assert reference.keys() == memoised.keys()
    for name, tensor in reference.items():
        assert torch.equal(tensor, memoised[name]), name
