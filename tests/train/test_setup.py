"""Which target weights a rank holds: the whole target where it runs the target's forward, else
(a disaggregated drafter rank) only what it reads."""

from __future__ import annotations

import pytest

from dflash_train.overrides import apply_overrides
from dflash_train.model.target.subset import TargetSubset
from dflash_train.recipes import tiny
from dflash_train.train.setup import target_subset
from dflash_train.train.parallel.topology import Topology


def _cfg(*overrides: str):
    return apply_overrides(tiny(), ["data.regenerate=false", "drafter.num_layers=2", *overrides])


def _disaggregated(rank: int) -> Topology:  # ranks 0-1: one target group of 2; ranks 2-3: drafters
    return Topology("disaggregated", world_size=4, rank=rank, local_rank=rank, num_target_ranks=2,
                    target_group_size=2)


@pytest.mark.parametrize("rank", [2, 3])
def test_drafter_ranks_hold_what_the_drafter_reads_and_copies(rank):
    assert target_subset(_cfg(), _disaggregated(rank), print) == TargetSubset(last_layers=2, final_norm=True)
    assert target_subset(_cfg("drafter.init_from_target=false"), _disaggregated(rank), print) == TargetSubset()


def test_ranks_that_run_the_target_hold_all_of_it():
    assert target_subset(_cfg(), _disaggregated(0), print) is None
    assert target_subset(_cfg(), Topology("colocated", 2, 1, 1, 0), print) is None


def test_the_main_drafter_rank_keeps_the_whole_target_to_regenerate():
    said = []
    assert target_subset(_cfg("data.regenerate=true"), _disaggregated(2), said.append) is None
    assert "data.regenerate" in said[0] and "dflash-train regenerate" in said[0]
    assert target_subset(_cfg("data.regenerate=true"), _disaggregated(3), said.append) == \
           TargetSubset(last_layers=2, final_norm=True)


def test_data_caches_are_keyed_by_the_targets_numerics(tiny_qwen3_target):
    """A bf16 or FP8 target answers and taps differently from a float32 one: their data caches in a
    shared work dir must not be read by a run with other numerics (keys name dtype and precision)."""
    import copy

    import torch

    from dflash_train.data.dataset import cache_key
    from dflash_train.train.setup import data_source_name

    cfg = _cfg()
    bf16 = copy.deepcopy(tiny_qwen3_target)
    bf16.model.to(torch.bfloat16)
    names = {data_source_name(cfg, tiny_qwen3_target), data_source_name(cfg, bf16),
             data_source_name(_cfg("target.precision=fp8"), tiny_qwen3_target)}
    assert len(names) == 3, names
    assert len({cache_key(cfg.data, name, 0) for name in names}) == 3
    assert data_source_name(cfg, tiny_qwen3_target) == f"{cfg.target.model}|float32"


def _tiny_target(config_name: str, model_name: str, tokenizer, **kwargs):
    import torch
    import transformers

    from dflash_train.model.target.target import Target

    torch.manual_seed(0)
    cfg = getattr(transformers, config_name)(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             vocab_size=len(tokenizer), **kwargs)
    return Target(model=getattr(transformers, model_name)(cfg).eval(), tokenizer=tokenizer, name=config_name)


def test_a_target_with_scaled_logits_trains_against_the_logits_it_is_served_with(smollm2_tokenizer):
    """Gemma 3 scales its embeddings, Cohere its logits (logit_scale): both drafter configs carry the
    factor, and the training loss's transform is Cohere's multiplier (its math: tests/train/loss/test_loss.py)."""
    from dflash_train.model.target.logits import LogitTransform
    from dflash_train.train.setup import build_drafter_config

    cfg = _cfg("drafter.num_taps=1")
    gemma = _tiny_target("Gemma3TextConfig", "Gemma3ForCausalLM", smollm2_tokenizer, sliding_window=8)
    assert build_drafter_config(cfg, gemma).input_embedding_scale == 8.0
    cohere = _tiny_target("CohereConfig", "CohereForCausalLM", smollm2_tokenizer, logit_scale=0.0625)
    dcfg = build_drafter_config(cfg, cohere)
    assert dcfg.output_multiplier == 0.0625 and LogitTransform.of(dcfg) == LogitTransform(0.0625, None)


def test_init_from_target_copies_the_factor_a_norm_applies(smollm2_tokenizer):
    """Gemma's norms multiply by 1 + w: the drafter's `x * w` norms start from that factor (`norm_factor`)."""
    import torch

    from dflash_train.model.drafter.config import drafter_config_from_target
    from dflash_train.model.target.target import norm_factor
    from dflash_train.train.setup import init_drafter

    gemma = _tiny_target("Gemma3TextConfig", "Gemma3ForCausalLM", smollm2_tokenizer, sliding_window=8)
    with torch.no_grad():
        for name, p in gemma.model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    assert torch.equal(norm_factor(gemma.final_norm), 1.0 + gemma.final_norm.weight)
    assert norm_factor(torch.nn.LayerNorm(8)) is None
    dcfg = drafter_config_from_target(gemma.config, num_layers=1, block_size=4, mask_token_id=3, num_taps=1)
    drafter = init_drafter(dcfg, gemma, seed=0, from_target=True, device="cpu")
    last = gemma.layers[-1]
    torch.testing.assert_close(drafter.norm.weight, 1.0 + gemma.final_norm.weight)
    torch.testing.assert_close(drafter.layers[0].self_attn.q_norm.weight, 1.0 + last.self_attn.q_norm.weight)
    torch.testing.assert_close(drafter.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    torch.testing.assert_close(drafter.hidden_norm.weight, 1.0 + last.input_layernorm.weight)


# --- node-local disks (issue 32, defect 7) ---------------------------------------------------------

def _node(prefix, private, shared, node: int, port: int, target, *extra):
    """One launcher of a 2-node job (2 processes each: rank 0 the target, ranks 1-3 drafters, rank 1
    the main one), in its own mount namespace where `shared` shows this node's `private` directory:
    the two nodes use the same paths and neither sees the other's files."""
    import subprocess
    import sys

    from test_pipeline import env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={port}", "--monitor-interval=0.5", "-m", "dflash_train", "train",
           "--recipe", "tiny", f"target.model={target}", "data.train=chitchat", "data.regenerate=false",
           "data.max_samples=60", "data.max_len=128", "drafter.num_taps=3", "train.seqs_per_step=3",
           "train.eval_every=100", "train.ckpt_every=2", "eval.num_prompts=0", "topology.mode=disaggregated",
           "topology.target_ranks=1", f"train.out_dir={shared}/run", *extra]
    bind = ["sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(private), str(shared)]
    return subprocess.Popen(prefix + bind + cmd, env=env(DFLASH_TRAIN_CACHE=f"{shared}/cache", HF_HOME=f"{shared}/hf"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _two_nodes(prefix, tmp_path, target, *extra):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [_node(prefix, tmp_path / f"node{n}", tmp_path / "shared", n, port, target, *extra) for n in (0, 1)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


@pytest.mark.slow
def test_each_node_reads_its_own_disk_and_resumes_without_the_main_nodes_files(tiny_target_dir, tmp_path):
    from test_full_disk import _unshare

    prefix = _unshare()
    if prefix is None:
        pytest.skip("no user+mount namespaces here (unshare --user --mount): cannot give each node its own disk")
    for n in (0, 1):
        (tmp_path / f"node{n}").mkdir()
    (tmp_path / "shared").mkdir()
    node0, node1 = _two_nodes(prefix, tmp_path, tiny_target_dir, "train.max_steps=2")
    assert "received from rank 1" in node1 and "this node's disk did not have it" in node1
    received = list((tmp_path / "node1" / "run" / "data").glob("samples-*.jsonl"))
    built = list((tmp_path / "node0" / "run" / "data").glob("samples-*.jsonl"))
    assert len(received) == 1 and [p.name for p in built] == [received[0].name]
    assert received[0].read_bytes() == built[0].read_bytes()
    assert not (tmp_path / "node1" / "run" / "checkpoints").exists()  # the main drafter rank writes them, on node 0
    node0, node1 = _two_nodes(prefix, tmp_path, tiny_target_dir, "train.max_steps=4", "train.resume=true")
    assert "resumed from" in node0 and "dflash-train train: OK (rank 1, drafter, 4 steps)" in node0
    assert "dflash-train train: OK (rank 3, drafter, 4 steps)" in node1
    assert (tmp_path / "node0" / "run" / "checkpoints" / "step_00000004").is_dir()


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_cuda_graphs_only_where_cuda_runs_the_compiled_step(mode):
    """train.compile_mode=reduce-overhead gives CUDA graphs (and masks at fixed addresses) on CUDA only: on a CPU
    the compiled step runs as the default, which the kernels line says."""
    from types import SimpleNamespace

    import torch

    from dflash_train.train import setup

    cfg = apply_overrides(tiny(), [f"train.compile_mode={mode}", "train.compile=on"])
    kernels = setup.resolve_kernels(cfg, torch.device("cpu"), SimpleNamespace(hidden_size=64))  # width: precision
    assert kernels.compiled and not kernels.graphs and kernels.compile_mode is None
    cuda = setup.Kernels("flex", True, ("bf16", "test"), graphs=mode == "reduce-overhead")
    assert cuda.compile_mode == ("reduce-overhead" if mode == "reduce-overhead" else None)
