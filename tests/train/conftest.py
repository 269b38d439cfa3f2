"""A tiny random Qwen3 target with the real SmolLM2 tokenizer, saved as an HF directory, so the
training tests run the real pipeline (real chitchat data, real chat template) in seconds."""

import signal
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from dflash_train.model.target import load as target_mod

    cached = target_mod.converted_gguf_dir(*target_mod.resolve_target("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(cached, local_files_only=True)
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer), tie_word_embeddings=True,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    out = tmp_path_factory.mktemp("tiny_qwen3_target")
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def disaggregated_reference(tiny_target_dir, tmp_path_factory):
    """One uninterrupted torchrun job of bench/chaos.py's kind (1 target + 2 drafter ranks, 10 steps, a
    checkpoint every 2) and its final weights: what the fault trials of test_chaos.py and
    watch/test_stop.py resume onto."""
    import subprocess

    from bench.chaos import Layout, env, final_weights, job

    out = tmp_path_factory.mktemp("disaggregated_reference") / "run"
    layout = Layout(targets=1, drafters=2, steps=10, target=str(tiny_target_dir),
                    extra=("drafter.num_taps=3", "data.max_len=128"))
    proc = subprocess.run(job(out, layout), env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return layout, final_weights(out)


@pytest.fixture
def contained(monkeypatch, tmp_path):
    """train() installs SIGTERM/SIGINT/SIGHUP handlers and points inductor's cache at the run's parent."""
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        monkeypatch.setenv(var, str(tmp_path / "inductor") if var.endswith("DIR") else "1")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield monkeypatch
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
