"""The serving commands printed at the end of `dflash-train train` name a target engines can load."""

from types import SimpleNamespace

from dflash_train.model.target import gguf_cache_dir
from dflash_train.train.command import served_target


def test_served_target_is_the_hub_id_the_converted_gguf_dir_or_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    assert served_target(SimpleNamespace(model="smollm2", gguf_file=None)) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    as_file = SimpleNamespace(model=str(gguf), gguf_file=None)
    assert served_target(as_file) == str(gguf)  # not converted yet: the file itself
    gguf_cache_dir(gguf).mkdir(parents=True)
    assert served_target(as_file) == str(gguf_cache_dir(gguf))  # safetensors + tokenizer: loads as is
    assert served_target(SimpleNamespace(model=str(tmp_path), gguf_file=None)) == str(tmp_path)
