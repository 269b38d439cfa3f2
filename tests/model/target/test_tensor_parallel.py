"""A target sharded over a group of 2 gloo processes gives the single-process taps and final
hidden state (float32, tiny random Qwen3 / Llama / Qwen3-MoE, and where the installed transformers
has them Gemma 3 (sliding window), Qwen3-Next and Qwen3.5 (hybrid linear attention)), and refuses
widths the group size does not divide and plans that shard no decoder layer (gpt-oss's)."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from dflash_train.model.target.target import Target, tap_relative_errors
from dflash_train.model.target.tensor_parallel import (check_tp_divisible, group_mesh, shard_target, split_plan,
                                                       tp_plan_of)

from tests.model.drafter.heads.test_architectures import ARCHS as OTHER_ARCHS, SMALL

# hybrid linear attention and sliding window, from test_architectures' tiny configs
HYBRID_AND_SLIDING = tuple(name for name in ("gemma3", "qwen3_next", "qwen3_5")
                           if all(hasattr(transformers, cls) for cls in OTHER_ARCHS[name][:2]))
ARCHS = ("qwen3", "llama", "qwen3_moe") + HYBRID_AND_SLIDING
# float32: the group's partial sums add in another order than one process's matmul, and the
# difference grows through the layers: up to ~1e-6 of each tap's norm, a few 1e-5 on single elements
REL_FROBENIUS = 3e-6  # ||got - want|| / ||want|| per tapped layer and for the final hidden state
RTOL, ATOL = 1e-4, 1e-4
def layer_ids(target) -> list[int]:
    """The first, second-to-last and last layer (the last one's tap is the final-norm output, as HF's)."""
    n = target.num_layers
    return [0, n - 2, n - 1]


def tiny(arch: str, seed: int = 0):
    """A seeded random float32 model; initializer_range 0.2 so that layers change the states."""
    torch.manual_seed(seed)
    common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=256, initializer_range=0.2, intermediate_size=128)
    if arch in OTHER_ARCHS:
        config_cls, model_cls, kwargs, _ = OTHER_ARCHS[arch]
        config = getattr(transformers, config_cls)(**SMALL, **kwargs, vocab_size=256, initializer_range=0.2)
        model = getattr(transformers, model_cls)(config)
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:  # every layer sparse: 4 experts of width 32, 2 per token
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                                   **common))
    return model.eval().requires_grad_(False)


def _compare_on_rank(rank: int, world: int, init_file: str, report_dir: str) -> None:
    """Each rank checks its architectures and, when all passed, writes the largest error it saw."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    worst = 0.0
    try:
        mesh = group_mesh([list(range(world))], "cpu")
        torch.manual_seed(1)
        ids = torch.randint(0, 256, (2, 24))  # (b, S)
        mask = torch.ones_like(ids)
        mask[0, :5] = 0  # a left-padded row
        for arch in ARCHS:
            reference = Target(tiny(arch), tokenizer=None)
            sharded = Target(shard_target(tiny(arch), mesh), tokenizer=None)
            for layer in sharded.layers:  # really sharded: every attention layer holds half its heads' weights
                attention = getattr(layer, "self_attn", None) or layer.linear_attn
                first = next(m for m in attention.children() if isinstance(m, torch.nn.Linear))
                assert first.weight.to_local().shape[0] * world == first.weight.shape[0], arch
            assert type(sharded.lm_head_weight) is torch.nn.Parameter  # replicated, plain
            ids_of_taps = layer_ids(reference)
            want_taps, want_last = reference.taps(ids, mask, ids_of_taps, return_last_hidden=True)
            got_taps, got_last = sharded.taps(ids, mask, ids_of_taps, return_last_hidden=True)
            assert type(got_taps) is torch.Tensor  # plain local tensors, whole on every rank
            errors = tap_relative_errors(torch.cat([want_taps, want_last], -1), torch.cat([got_taps, got_last], -1),
                                         len(ids_of_taps) + 1)
            assert max(errors) < REL_FROBENIUS, (arch, errors)
            worst = max(worst, max(errors))
            torch.testing.assert_close(got_taps, want_taps, rtol=RTOL, atol=ATOL, msg=lambda m: f"{arch} taps: {m}")
            torch.testing.assert_close(got_last, want_last, rtol=RTOL, atol=ATOL, msg=lambda m: f"{arch} last: {m}")
            assert want_taps.abs().max() > 1.0  # the states are not ~0: the tolerance means something
        (Path(report_dir) / f"rank{rank}").write_text(f"{worst}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_taps_equal_single_process_taps(tmp_path):
    mp.spawn(_compare_on_rank, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2, join=True)
    worst = [float((tmp_path / f"rank{r}").read_text()) for r in range(2)]  # both ranks checked every arch
    assert all(0.0 <= w < REL_FROBENIUS for w in worst), worst


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tested_architecture_has_a_plan(arch):
    plan = tp_plan_of(tiny(arch).config)
    assert plan["layers.*.self_attn.q_proj"] == "colwise" and plan["layers.*.self_attn.o_proj"] == "rowwise"


def test_widths_the_group_size_does_not_divide_are_refused():
    config = Qwen3Config(hidden_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                         intermediate_size=96)
    check_tp_divisible(config, 3)  # 6, 3 and 96 all divide by 3
    with pytest.raises(ValueError, match=r"num_attention_heads=6, num_key_value_heads=3 not divisible by "
                                         r"topology.target_group_size=4; group sizes that divide every "
                                         r"sharded width: \[1, 3\]"):
        check_tp_divisible(config, 4)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_tp_divisible(config, 2)


def test_a_plan_that_shards_no_decoder_layer_is_refused():
    """gpt-oss's config plan names only its embedding (kept whole here): no memory would be saved."""
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no GptOssConfig")
    config_cls, model_cls, kwargs, _ = OTHER_ARCHS["gpt_oss"]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SMALL, **kwargs, vocab_size=256))
    with pytest.raises(ValueError, match="gpt_oss: its tensor-parallel plan .* shards no decoder layer"):
        split_plan(model)
    assert split_plan(tiny("qwen3"))[0]  # a plan that does shard layers passes


def test_a_config_without_a_plan_is_refused():
    config = Qwen3Config()
    config.base_model_tp_plan = None
    with pytest.raises(ValueError, match="no tensor-parallel plan.*target_group_size=1"):
        tp_plan_of(config)
