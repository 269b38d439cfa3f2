"""Target: taps equal HF `hidden_states[i + 1]`, the forward stops after the last tap, and the
mask token resolves per spec 1.4."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.cache import MARKER
from dflash_train.model.target.taps import build_target_layer_ids
from dflash_train.model.target.target import Target, resolve_mask_token_id
from dflash_train.model.target.load import gguf_cache_dir, resolve_target
from tests.conftest import tiny_qwen3


@pytest.fixture(scope="module")
def tiny():
    return Target(model=tiny_qwen3(vocab_size=300, seed=1), tokenizer=None, name="tiny")


def _reference(model, ids, mask, layer_ids):
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1), out


def test_default_ids_follow_z_lab():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert build_target_layer_ids(6, 1) == [3]


def test_taps_equal_hf_hidden_states(tiny):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding: valid tokens are unaffected
    for layer_ids in ([1, 2, 3], [0], [4, 1], [5], [0, 5]):  # 5 = last layer: HF's entry is post-norm
        ref, _ = _reference(tiny.model, ids, mask, layer_ids)
        got = tiny.taps(ids, mask, layer_ids)
        assert got.shape == (2, 12, 64 * len(layer_ids)) and got.dtype == torch.float32
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1, :9], ref[1, :9], rtol=0, atol=0)


def test_compiled_layers_give_the_same_taps_with_one_graph():
    """`compile_layers` (training taps on GPU) against the HF reference; the layers share one
    graph per kind of part (attention, MLP, norm), the stop-after-last-tap hook still stops the
    forward, and the force_eager stance (generation) runs other shapes without compiling."""
    from torch._dynamo.utils import counters

    target = Target(model=tiny_qwen3(vocab_size=300, seed=2), tokenizer=None, name="tiny")
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    # the reference runs on an identical copy: HF's output_hidden_states installs capture hooks on
    # the attention modules that a compiled layer could not trace (a graph break per layer)
    ref, _ = _reference(tiny_qwen3(vocab_size=300, seed=2), ids, mask, [1, 3])
    torch._dynamo.reset()
    counters.clear()
    target.compile_layers()
    ran = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(target.layers)]
    try:
        got = target.taps(ids, mask, [1, 3])
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert ran == [0, 1, 2, 3]  # stopped after layer 3 of 6
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    with torch.compiler.set_stance("force_eager"):
        short = target.taps(ids[:, :7], mask[:, :7], [1, 3])
    assert counters["stats"]["unique_graphs"] == 3  # no graph for the new shape
    torch.testing.assert_close(short, ref[:, :7], rtol=1e-5, atol=1e-5)


def test_left_padding_matches_unpadded(tiny):
    ids = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], dim=1)
    alone = tiny.taps(ids, None, [1, 3])
    torch.testing.assert_close(tiny.taps(padded, mask, [1, 3])[:, 3:], alone, rtol=1e-5, atol=1e-5)


def test_forward_stops_after_last_tap_unless_last_hidden_is_asked(tiny):
    ran = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(tiny.layers)]
    try:
        ids = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(2))
        tiny.taps(ids, None, [3, 1])
        assert ran == [0, 1, 2, 3]
        ran.clear()
        taps, last = tiny.taps(ids, None, [1, 3], return_last_hidden=True)
        assert ran == list(range(6))
    finally:
        for h in handles:
            h.remove()
    ref, out = _reference(tiny.model, ids, None, [1, 3])
    torch.testing.assert_close(taps, ref, rtol=0, atol=0)
    torch.testing.assert_close(last, out.hidden_states[-1], rtol=0, atol=0)
    torch.testing.assert_close(last @ tiny.lm_head_weight.T, out.logits, rtol=1e-5, atol=1e-5)


def test_target_properties_and_bad_ids(tiny):
    assert (tiny.num_layers, tiny.hidden_size, tiny.vocab_size) == (6, 64, 300)
    assert tiny.lm_head_weight is tiny.embed_weight  # tied embeddings share one tensor
    assert tiny.final_norm is tiny.model.model.norm
    assert tiny.dtype == torch.float32 and tiny.device.type == "cpu"
    untied = Target(model=tiny_qwen3(vocab_size=300, tie=False), tokenizer=None)
    assert untied.lm_head_weight is not untied.embed_weight
    with pytest.raises(ValueError, match="tap layer ids"):
        tiny.taps(torch.zeros(1, 3, dtype=torch.long), None, [6])


def test_resolve_target_paths(tmp_path):
    path, gguf = resolve_target("smollm2")
    assert gguf == "SmolLM2-135M-Instruct.Q4_1.gguf" and (Path(path) / gguf).is_file()
    assert resolve_target(str(Path(path) / gguf)) == (path, gguf)
    assert resolve_target("some/hf-dir") == ("some/hf-dir", None)
    with pytest.raises(FileNotFoundError):
        resolve_target(str(tmp_path / "missing.gguf"))


def test_mask_token_resolution_order(smollm2_tokenizer, capsys):
    tok = smollm2_tokenizer
    assert len(tok) == 49152
    assert resolve_mask_token_id(tok, 49152, explicit=5) == 5
    assert resolve_mask_token_id(tok, 49216) == 49152  # first unused embedding row
    chosen = resolve_mask_token_id(tok, 49152)  # table full: a reserved special token
    assert tok.convert_ids_to_tokens(chosen) == "<empty_output>"
    assert chosen not in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.unk_token_id)
    assert "reserved special token '<empty_output>'" in capsys.readouterr().out
    with pytest.raises(ValueError, match="outside the embedding table"):
        resolve_mask_token_id(tok, 49152, explicit=49152)


@pytest.mark.slow
def test_smollm2_taps_equal_hf_hidden_states(smollm2_target):
    t = smollm2_target
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (30, 576, 49152)
    assert t.dtype == torch.float32 and not t.model.training
    assert not any(p.requires_grad for p in t.model.parameters())
    assert t.lm_head_weight is t.embed_weight
    enc = t.tokenizer(["The quick brown fox jumps over the lazy dog.", "Hello!"], padding=True,
                      return_tensors="pt")
    layer_ids = build_target_layer_ids(t.num_layers, 5)
    ref, out = _reference(t.model, enc.input_ids, enc.attention_mask, layer_ids)
    taps, last = t.taps(enc.input_ids, enc.attention_mask, layer_ids, return_last_hidden=True)
    valid = enc.attention_mask.bool()
    torch.testing.assert_close(taps[valid], ref[valid], rtol=0, atol=0)
    torch.testing.assert_close(last[valid], out.hidden_states[-1][valid], rtol=0, atol=0)


def test_load_target_from_a_local_dir_is_frozen_in_the_asked_dtype(tiny_qwen3_dir):
    from dflash_train.model.target.load import load_target

    t = load_target(str(tiny_qwen3_dir), dtype="bfloat16")
    assert t.dtype == torch.bfloat16 and not t.model.training
    assert not any(p.requires_grad for p in t.model.parameters())
    assert t.tokenizer.eos_token == "<|im_end|>" and t.num_layers == 6
    with pytest.raises(OSError, match="never downloads"):
        load_target("nobody/not-a-cached-model")


# Each of 3 gloo ranks loads SmolLM2 from an empty cache (the 5+3 layout had 8; ranks 1 and 2 race for the
# lock as 7 did, and exactly one converts). Rank 0 joins once another rank holds the conversion lock: transformers 5 saves model files on rank 0 only, which is how the 5+3 layout
# first got a tokenizer-only "conversion".
_LOAD_ON_EVERY_RANK = """
import os, time
from pathlib import Path
import torch.distributed as dist
from dflash_train.cache import lock_path_of
from dflash_train.model.target.load import gguf_cache_dir, load_target, resolve_target

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"RANK {rank} PID {os.getpid()}", flush=True)
if rank == 0:
    lock = lock_path_of(gguf_cache_dir(Path(*resolve_target("smollm2"))))
    while not (lock.is_file() and lock.read_text().strip()):
        time.sleep(0.1)
target = load_target("smollm2")
print(f"LOADED {rank} {target.num_layers}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_three_ranks_on_an_empty_cache_convert_the_gguf_once(tmp_path, monkeypatch):
    script = tmp_path / "load_on_every_rank.py"
    script.write_text(_LOAD_ON_EVERY_RANK)
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))  # empty
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                           str(script)], env=env, capture_output=True, text=True, timeout=800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert sorted(re.findall(r"LOADED (\d) 30", out)) == [str(r) for r in range(3)]
    assert out.count("target: converting") == 1
    assert "cache: waiting for the HF conversion of SmolLM2-135M-Instruct.Q4_1.gguf being built by pid" in out
    pids = {int(pid): int(rank) for rank, pid in re.findall(r"RANK (\d) PID (\d+)", out)}
    marker = json.loads((gguf_cache_dir(Path(*resolve_target("smollm2"))) / MARKER).read_text())
    assert pids[marker["pid"]] != 0  # the conversion ran on a non-zero rank, and it is whole
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(marker["files"])
