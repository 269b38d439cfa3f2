"""`dflash-train check` on a fresh machine, for every form a target takes: a GGUF file whose HF
conversion is not cached yet (the check converts it, once, as training would) and then is; a local HF
directory; a hub id already in the Hugging Face cache. Each run starts from an empty dflash-train
cache and an HF hub cache that holds only what the test puts there.

Real parts: a tiny random Llama written as a real GGUF file (F32 tensors, the SmolLM2 GGUF's own
tokenizer metadata) and converted by transformers; the tiny random Qwen3 saved as an HF directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from dflash_train import cli
from dflash_train.model.target import load as target_mod
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.drafter.export.hf_format import save_zlab

LAYERS, HIDDEN, HEADS, KV_HEADS, FF = 4, 64, 4, 2, 128


def write_tiny_gguf(out: Path, seed: int = 0, tokenizer: bool = True) -> Path:
    """A tiny random Llama as an F32 GGUF file, with the SmolLM2 GGUF's tokenizer (and chat template); without it
    (`tokenizer=False`: weights only, a 256-row embedding), a read by transformers skips the 49,152 tokens' metadata
    that takes most of its ~5 s here."""
    import gguf

    source = gguf.GGUFReader("/".join(target_mod.resolve_target("smollm2"))) if tokenizer else None
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, field in source.fields.items() if source else ():
        if key.startswith("tokenizer."):
            w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[1] if len(field.types) > 1 else None)
    if not tokenizer:
        w.add_vocab_size(256)
    rng = np.random.default_rng(seed)

    def rand(*shape):  # [out, in], as the GGUF stores a linear layer's weight
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    vocab = len(source.fields["tokenizer.ggml.tokens"].contents()) if tokenizer else 256
    kv_width = KV_HEADS * HIDDEN // HEADS
    w.add_tensor("token_embd.weight", rand(vocab, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv_width, HIDDEN), "attn_v": (kv_width, HIDDEN),
                  "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FF, HIDDEN), "ffn_up": (FF, HIDDEN),
                  "ffn_down": (HIDDEN, FF)}
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def exported_drafter(target_config, out: Path) -> Path:
    """A random drafter for a target of this config, as an export without a recorded training target."""
    cfg = drafter_config_from_target(target_config, num_layers=1, block_size=4, mask_token_id=3, num_taps=1)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(0))
    return save_zlab(drafter, out)


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    """An empty dflash-train cache and an empty HF hub cache."""
    import huggingface_hub.constants

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "dflash-cache"))
    hub = tmp_path / "hf-hub"
    hub.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    return tmp_path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def _check(drafter: Path, target: str, capsys) -> tuple[int, str]:
    code = cli.main(["check", str(drafter), "--target", target])
    return code, capsys.readouterr().out


@pytest.mark.slow  # a GGUF conversion by transformers: ~15 s on two cores
def test_a_gguf_target_is_converted_once_then_read_from_the_cache(tiny_gguf, fresh_home, capsys):
    llama = LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        num_key_value_heads=KV_HEADS, intermediate_size=FF, vocab_size=49152)
    drafter = exported_drafter(llama, fresh_home / "drafter")
    code, out = _check(drafter, str(tiny_gguf), capsys)
    assert code == 0, out
    assert "converting tiny-llama.gguf" in out and "(gguf ALL_F32), 4 layers, hidden 64, vocab 49152" in out
    converted = target_mod.gguf_cache_dir(tiny_gguf)
    assert converted.is_relative_to(fresh_home / "dflash-cache") and (converted / "config.json").is_file()
    code, out = _check(drafter, str(tiny_gguf), capsys)  # converted already: read, not converted again
    assert code == 0 and "converting" not in out and out.splitlines()[-1].startswith("dflash-train check: OK")


def test_an_hf_directory_target(tiny_qwen3_target, tiny_qwen3_dir, fresh_home, capsys):
    drafter = exported_drafter(tiny_qwen3_target.config, fresh_home / "drafter")
    code, out = _check(drafter, str(tiny_qwen3_dir), capsys)
    assert code == 0, out
    cached = {p.relative_to(fresh_home / "dflash-cache").parts[0] for p in (fresh_home / "dflash-cache").rglob("*")
              if p.is_file()}
    assert cached <= {"sha256"}  # nothing converted: only the weights' content hash, kept per file version


def test_a_hub_id_in_the_hf_cache(tiny_qwen3_target, tiny_qwen3_dir, fresh_home, capsys):
    """A hub id is looked up in the HF cache only (never downloaded): absent, the check says so; once
    its snapshot is in the cache, the check passes against it."""
    drafter = exported_drafter(tiny_qwen3_target.config, fresh_home / "drafter")
    code, out = _check(drafter, "tiny-org/tiny-qwen3", capsys)
    assert code != 0 and "not in the Hugging Face cache" in out
    repo = fresh_home / "hf-hub" / "models--tiny-org--tiny-qwen3"
    shutil.copytree(tiny_qwen3_dir, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    code, out = _check(drafter, "tiny-org/tiny-qwen3", capsys)
    assert code == 0, out
    assert "0123abcd" in out and "vllm serve TARGET" in out  # no training target recorded in this drafter
