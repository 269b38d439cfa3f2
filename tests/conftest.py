"""Shared fixtures: the real SmolLM2 target (loaded once per session), its tokenizer, and a tiny
random Qwen3 target that uses the SmolLM2 tokenizer (real chat template, fast on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _smollm2_hf_dir() -> Path:
    """The cached HF conversion of the embedded SmolLM2 GGUF (converted on first use, ~40 s)."""
    from dflash_train.model.target import load as target_mod

    return target_mod.converted_gguf_dir(*target_mod.resolve_target("smollm2"))


@pytest.fixture(scope="session")
def smollm2_target():
    """The real SmolLM2-135M-Instruct target (fp32, CPU), via `load_target("smollm2")`."""
    from dflash_train.model.target.load import load_target

    return load_target("smollm2")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """Only the SmolLM2 tokenizer (ChatML template, 49,152 tokens), without the model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_smollm2_hf_dir(), local_files_only=True)


def tiny_qwen3(vocab_size: int, seed: int = 0, layers: int = 6, hidden: int = 64, tie: bool = True,
               init_std: float = 0.02):
    """A seeded random Qwen3; `init_std` is HF's initializer_range (its default 0.02 gives a nearly
    flat tied lm_head, so a drafter's loss hardly moves from ln V; 0.2 lets training show)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab_size,
                      tie_word_embeddings=tie, max_position_embeddings=4096, initializer_range=init_std)
    return Qwen3ForCausalLM(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny_qwen3_target(smollm2_tokenizer):
    """A seeded random 6-layer, hidden-64 Qwen3 over the SmolLM2 tokenizer, as a `Target`."""
    from dflash_train.model.target.target import Target

    model = tiny_qwen3(len(smollm2_tokenizer))
    model.generation_config.eos_token_id = smollm2_tokenizer.eos_token_id
    return Target(model=model, tokenizer=smollm2_tokenizer, name="tiny-qwen3")


def save_tiny_qwen3_dir(out: Path, tokenizer, init_std: float = 0.02) -> Path:
    """Save the seeded tiny Qwen3 over `tokenizer` as an HF directory (the `tiny_qwen3_dir` fixture;
    also used by tests/golden/regenerate.py, which runs outside pytest)."""
    model = tiny_qwen3(len(tokenizer), init_std=init_std)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_dir(smollm2_tokenizer, tmp_path_factory) -> Path:
    """The tiny Qwen3 target saved as an HF directory (for CLI tests that load by path)."""
    return save_tiny_qwen3_dir(tmp_path_factory.mktemp("tiny_qwen3"), smollm2_tokenizer)
