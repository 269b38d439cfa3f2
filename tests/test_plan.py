"""`plan`: parameter counts and memory against hand arithmetic, the measured H200 peaks (docs/PERF.md
3.1, issue 17) within 10 %, FLOP counts against bench/flops.py's, and layout ordering."""

from __future__ import annotations

import pytest
import transformers

from dflash_train import cli, plan, recipes

TOLERANCE = 0.10  # the goal for the measured peaks


@pytest.fixture(scope="module")
def qwen3_8b():
    return plan.target_shape(plan.load_target_config("qwen3-8b"))


def test_qwen3_8b_counts_by_hand(qwen3_8b):
    h, v, i = 4096, 151936, 12288
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 2 * 128 + 3 * h * i + 2 * h  # attention, q/k norms, MLP, norms
    assert qwen3_8b.total_params == 36 * layer + 2 * v * h + h == 8_190_735_360
    assert qwen3_8b.active_params == qwen3_8b.total_params and qwen3_8b.embedding_params == 2 * v * h
    d = plan.drafter_config(qwen3_8b, plan.RunShape())
    assert plan.drafter_params(d) == 5 * layer + 5 * h * h + 2 * h  # spec 1.2: ~1.05B
    # 14 B/param at the peak of a single micro-batch step, 18 when gradients accumulate (float32 sums)
    one = plan.drafter_memory(qwen3_8b, plan.RunShape())
    accum = plan.drafter_memory(qwen3_8b, plan.RunShape(grad_accum=8))
    assert one.parts["state"] == 14 * plan.drafter_params(d) and accum.parts["state"] == 18 * plan.drafter_params(d)
    assert one.parts["loss_chunk"] == 2048 * v * 4 and one.parts["taps"] == 3072 * 5 * h * 2


@pytest.mark.parametrize("name", ["qwen3_moe", "llama", "mixtral"])
def test_analytic_counts_equal_the_meta_built_model(name):
    """The formula against transformers' own modules (tiny configs; MoE with dense-only layers too)."""
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=False)
    cfg = {"qwen3_moe": lambda: transformers.Qwen3MoeConfig(**kw, moe_intermediate_size=32, num_experts=4,
                                                          num_experts_per_tok=2, mlp_only_layers=[1]),
           "llama": lambda: transformers.LlamaConfig(**kw, attention_bias=True),
           "mixtral": lambda: transformers.MixtralConfig(**kw, num_local_experts=4, num_experts_per_tok=2)}[name]()
    assert plan._analytic_counts(cfg) == plan._meta_counts(cfg)


def test_flops_equal_bench_flops_at_the_paper_shapes(qwen3_8b):
    """PERF.md section 1: drafter train step 71.46 TFLOP, tapped prefill 42.93 TFLOP per sequence."""
    d = plan.drafter_config(qwen3_8b, plan.RunShape())
    assert plan.drafter_flops(d, plan.RunShape()) / 1e12 == pytest.approx(71.46, abs=0.01)
    assert plan.target_flops(qwen3_8b, plan.RunShape()) / 1e12 == pytest.approx(42.93, abs=0.01)
    assert plan.rates(qwen3_8b, plan.RunShape()) == pytest.approx((22_900.0, 42_600.0))


@pytest.mark.parametrize("what, measured_gib", [
    ("drafter step, paper shapes (PERF.md 3.1)", 23.6),
    ("drafter step, B 32 / N 64 (PERF.md 3.1)", 19.1),
    ("target tapped prefill, 4 x 3072 (PERF.md 3.1)", 17.5),
    ("colocated Qwen3-8B train, paper recipe (issue 17)", 40.7),
    ("Qwen3-30B-A3B tapped prefill, 4 x 3072 (PERF.md 3.1, session 7)", 58.4),
])
def test_predictions_match_the_measured_h200_peaks(qwen3_8b, what, measured_gib):
    predicted = {
        "drafter step, paper shapes (PERF.md 3.1)": lambda: plan.drafter_memory(qwen3_8b, plan.RunShape()),
        "drafter step, B 32 / N 64 (PERF.md 3.1)": lambda: plan.drafter_memory(
            qwen3_8b, plan.RunShape(block_size=32, num_anchors=64)),
        "target tapped prefill, 4 x 3072 (PERF.md 3.1)": lambda: plan.target_memory(qwen3_8b, plan.RunShape(micro_batch=4)),
        "colocated Qwen3-8B train, paper recipe (issue 17)": lambda: plan.colocated_memory(
            qwen3_8b, plan.RunShape.from_run_config(recipes.get("paper"))),
        "Qwen3-30B-A3B tapped prefill, 4 x 3072 (PERF.md 3.1, session 7)": lambda: plan.target_memory(
            plan.target_shape(plan.load_target_config("qwen3-30b-a3b")), plan.RunShape(micro_batch=4)),
    }[what]().total_gib
    assert abs(predicted - measured_gib) / measured_gib < TOLERANCE, f"{what}: {predicted:.1f} vs {measured_gib}"


def test_layouts_smallest_first_and_big_targets_need_more(qwen3_8b):
    run = plan.RunShape(grad_accum=8)
    two = plan.layouts(qwen3_8b, run, 2)
    assert [lay.name for lay in two] == ["colocated", "disaggregated 1T+1D"]  # colocated is faster on 2
    assert two[0].tokens_per_s == pytest.approx(2 / (1 / 22_900 + 1 / 42_600))
    assert two[1].tokens_per_s == pytest.approx(22_900)
    best = plan.smallest_fitting(qwen3_8b, run, 8)
    assert best[0].gpus == 1 and best[0].name == "colocated"
    four = plan.layouts(qwen3_8b, run, 4)
    assert [lay.tokens_per_s for lay in four if lay.fits] == sorted((lay.tokens_per_s for lay in four if lay.fits),
                                                                    reverse=True)
    # a 70B target does not fit colocated on one H200; the smallest fit is one target + one drafter GPU
    llama = plan.target_shape(plan.load_target_config("llama-3.3-70b"))
    assert not plan.layouts(llama, run, 1)[0].fits
    assert plan.smallest_fitting(llama, run, 8)[0].name == "disaggregated 1T+1D"
    assert plan.smallest_fitting(llama, run, 8, gpu_gib=80.0) == [] and plan.weights_need_gpus(llama, 80.0) == 2
    # on 120 GiB one target does not fit but a drafter does: target groups of 2, sharded or staged
    best = plan.smallest_fitting(llama, run, 8, gpu_gib=120.0)
    assert best[0].gpus == 3 and {lay.name for lay in best} == {"disaggregated 2T+1D (TP 2)", "disaggregated 2T+1D (PP 2)"}
    whole = plan.target_memory(llama, run).parts["weights"]
    layers = whole - llama.embedding_params * plan.BF16
    tp = plan.target_memory(llama, run, group=2, parallel="tensor").parts["weights"]
    pp = plan.target_memory(llama, run, group=4, parallel="pipeline").parts["weights"]
    assert tp == pytest.approx(layers / 2 + llama.embedding_params * plan.BF16)
    assert pp == pytest.approx(layers / 4 + llama.embedding_params * plan.BF16)  # 80 layers: 20 per stage
    assert best[0].overrides() == ("topology.mode=disaggregated topology.target_ranks=2 topology.target_group_size=2 "
                                   f"topology.target_parallel={best[0].parallel}")


def test_plan_command_prints_layouts_and_a_verdict(capsys):
    assert cli.main(["plan", "--target", "qwen3-30b-a3b", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "30.53B parameters (3.35B active)" in out and "disaggregated 1T+1D" in out
    assert "dflash-train plan: OK smallest: colocated on 1 GPU(s)" in out
    assert cli.main(["plan", "--target", "llama-3.3-70b", "--gpus", "1", "--gpu-gib", "80"]) == 1
    out = capsys.readouterr().out
    assert "dflash-train plan: FAILED: no layout" in out and "target group of 2 GPUs" in out


def test_plan_flags_are_config_fields_and_bad_values_fail_before_planning(capsys):
    assert cli.main(["plan", "plan.gpus=0"]) == 2  # a ConfigError: nothing computed
    assert "plan.gpus=0: must be > 0" in capsys.readouterr().out
    assert cli.main(["plan", "--target", "no-such-shape"]) == 1
    assert "FAILED: target 'no-such-shape': not a known shape" in capsys.readouterr().out
