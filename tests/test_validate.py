"""Every rule of dflash_train/validate.py fires with its field named (and a valid run passes), without
loading a model: the checks that run before anything heavy."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_train import recipes, validate
from dflash_train.config import ConfigError, RunConfig
from dflash_train.overrides import apply_overrides
from dflash_train.train.parallel.topology import Topology

ONE = Topology("colocated", 1, 0, 0, 0)


def with_(cfg: RunConfig, key: str, value) -> RunConfig:
    """`key=value` set directly (bypassing the override parser, as a recipe or config.json could)."""
    section, name = key.split(".")
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})


def fires(check, cfg, *args, match: str) -> None:
    with pytest.raises(ConfigError) as info:
        check(cfg, *args)
    assert match in str(info.value), str(info.value)


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_every_recipe_passes(name):
    cfg = recipes.get(name)
    assert validate.config_problems(cfg) == []
    assert validate.check_topology(cfg, 1) == []
    validate.validate_config(cfg)  # raise ConfigError on any problem
    validate.validate_run(cfg, ONE)


@pytest.mark.parametrize("key", ["topology.mode", "train.attention", "train.compile", "target.dtype", "loss.kind",
                                 "data.shard_format", "export.format", "export.dtype", "doctor.devices",
                                 "eval.draft_vocab"])
def test_enum_fields_take_only_their_allowed_values(key):
    fires(validate.validate_config, with_(RunConfig(), key, "bogus"), match=f"{key}='bogus': expected one of")


@pytest.mark.parametrize("key", validate.POSITIVE)
def test_sizes_must_be_positive(key):
    fires(validate.validate_config, with_(RunConfig(), key, 0), match=f"{key}=0: must be > 0")


@pytest.mark.parametrize("key", validate.NON_NEGATIVE)
def test_non_negative_fields(key):
    fires(validate.validate_config, with_(RunConfig(), key, -1), match=f"{key}=-1: must be >= 0")


@pytest.mark.parametrize("key,bad,good", [("data.eval_fraction", 1.0, 0.99), ("data.eval_fraction", -0.1, 0.0),
                                          ("optim.warmup_ratio", 1.0, 0.5), ("optim.min_lr_ratio", 1.5, 1.0)])
def test_fractions_in_range(key, bad, good):
    fires(validate.validate_config, with_(RunConfig(), key, bad), match=f"{key}={bad}: must be in [0.0, 1.0")
    validate.validate_config(with_(RunConfig(), key, good))


def test_block_size_at_least_two_betas_and_layer_ids():
    fires(validate.validate_config, with_(RunConfig(), "drafter.block_size", 1),
          match="drafter.block_size=1: must be >= 2")
    fires(validate.validate_config, with_(RunConfig(), "eval.block_size", 1), match="eval.block_size=1: must be >= 2")
    fires(validate.validate_config, with_(RunConfig(), "optim.betas", (0.9, 1.0)), match="optim.betas=(0.9, 1.0)")
    fires(validate.validate_config, with_(RunConfig(), "target.layer_ids", (1, -2)), match="target.layer_ids=(1, -2)")


def test_all_problems_are_listed_at_once():
    cfg = with_(with_(RunConfig(), "train.epochs", 0), "topology.mode", "bogus")
    fires(validate.validate_config, cfg, match="2 config problems: ")
    fires(validate.validate_config, cfg, match="topology.mode='bogus': expected one of")
    fires(validate.validate_config, cfg, match="train.epochs=0: must be > 0")


def test_the_issue_layout_names_the_nearest_valid_batch():
    """5 target + 3 drafter ranks with the tiny recipe's 4 sequences per step (issue 15)."""
    cfg = apply_overrides(recipes.get("tiny"), ["topology.mode=disaggregated", "topology.target_ranks=5"])
    topo = Topology("disaggregated", 8, 0, 0, 5)
    fires(validate.validate_run, cfg, topo, match="train.seqs_per_step=4 is not a multiple of train.micro_batch (1) "
                                                  "x drafter ranks (3) = 3: use train.seqs_per_step=3 or 6")
    validate.validate_run(with_(cfg, "train.seqs_per_step", 6), topo)
    two = with_(with_(cfg, "train.seqs_per_step", 2), "train.micro_batch", 2)  # per step 2 x 3 = 6
    fires(validate.validate_run, two, topo, match="use train.seqs_per_step=6")


def test_target_ranks_must_leave_a_drafter_rank():
    cfg = apply_overrides(recipes.get("tiny"), ["topology.mode=disaggregated", "topology.target_ranks=8"])
    fires(validate.validate_run, cfg, Topology("disaggregated", 8, 0, 0, 7),
          match="topology.target_ranks=8 leaves no drafter rank in a world of 8 processes: "
                "use topology.target_ranks=1..7")
    assert "topology.mode=disaggregated needs at least 2 processes" in validate.check_topology(cfg, 1)[0]
    assert validate.check_topology(with_(cfg, "topology.target_ranks", 7), 8) == []


def test_training_rules():
    tiny = recipes.get("tiny")
    validate.validate_run(with_(tiny, "loss.kind", "kl"), ONE)  # distillation trains (tests/train/test_distill.py)
    fires(validate.validate_run, with_(tiny, "loss.kl_weight", 1.5), ONE,
          match="loss.kl_weight=1.5: must be in [0.0, 1.0]")
    disagg = apply_overrides(tiny, ["topology.mode=disaggregated", "train.max_minutes=5"])
    fires(validate.validate_run, disagg, Topology("disaggregated", 2, 0, 0, 1), match="train.max_minutes needs")
    fires(validate.validate_run, with_(tiny, "topology.device", "cpu"), ONE, match="topology.device=cpu: train places")
    fires(validate.validate_run, with_(tiny, "data.max_samples", 3), ONE,
          match="data.max_samples=3 cannot fill one step of train.seqs_per_step=4")


def test_cuda_graphs_need_a_compiled_step_of_one_micro_batch():
    """train.compile_mode=reduce-overhead replays one recorded forward and backward per step."""
    graphs = with_(recipes.get("tiny"), "train.compile_mode", "reduce-overhead")  # 4 seqs/step, micro-batch 1
    fires(validate.validate_run, graphs, ONE, match="train.compile_mode=reduce-overhead with 4 micro-batches per step "
                                                    "(train.seqs_per_step=4 / train.micro_batch=1 / 1 drafter rank(s)): "
                                                    "CUDA graphs need one; set train.micro_batch=4")
    one = with_(graphs, "train.micro_batch", 4)
    validate.validate_run(one, ONE)
    fires(validate.validate_run, with_(one, "train.compile", "off"), ONE,
          match="train.compile_mode=reduce-overhead with train.compile=off")


def test_offline_needs_prepared_shards(tmp_path):
    offline = with_(recipes.get("tiny"), "topology.mode", "offline")
    topo = Topology("offline", 1, 0, 0, 0)
    fires(validate.validate_run, offline, topo, match="topology.mode=offline needs data.shards=DIR")
    shards = with_(offline, "data.shards", str(tmp_path))
    fires(validate.validate_run, shards, topo, match=f"data.shards={tmp_path}: no index.json there")
    (tmp_path / "index.json").write_text("{}")
    validate.validate_run(with_(shards, "data.train", str(tmp_path / "unused.jsonl")), topo)  # not read offline


def test_inputs_that_must_exist(tmp_path):
    tiny = recipes.get("tiny")
    missing = str(tmp_path / "nope.jsonl")
    fires(validate.validate_run, with_(tiny, "data.train", missing), ONE, match=f"data.train={missing}: no such file")
    fires(validate.validate_run, with_(tiny, "eval.prompts", missing), ONE, match="not a set name (default, chitchat, assistant, humaneval, synthesized, heldout, prose) and not a JSONL file")
    fires(validate.validate_run, with_(tiny, "target.model", str(tmp_path / "m")), ONE, match="target.model=")
    fires(validate.validate_run, with_(tiny, "target.model", "./m.gguf"), ONE, match="target.model=./m.gguf")
    validate.validate_run(with_(tiny, "target.model", "Org/cached-hub-id"), ONE)  # the loader says if it is not cached
    with_gguf = with_(with_(tiny, "target.model", str(tmp_path)), "target.gguf_file", "x.gguf")
    fires(validate.validate_run, with_gguf, ONE, match="target.gguf_file=x.gguf: not found")


def test_command_requirements(tmp_path):
    cfg = RunConfig()
    fires(validate.validate_eval, cfg, match="eval.drafter is not set")
    fires(validate.validate_eval, with_(cfg, "eval.drafter", str(tmp_path)), match="no config.json there")
    (tmp_path / "config.json").write_text("{}")
    validate.validate_eval(with_(cfg, "eval.drafter", str(tmp_path)))
    fires(validate.validate_regenerate, cfg, match="data.regen_out is not set")
    fires(validate.validate_prepare, cfg, match="data.shards is not set")
    fires(validate.validate_prepare, with_(cfg, "data.shards", str(tmp_path)), match="data.train=default holds prompts")
    fires(validate.validate_export, cfg, match="export.drafter is not set")
    fires(validate.validate_export, with_(cfg, "export.drafter", str(tmp_path)), match="export.out is not set")
    spec = with_(with_(with_(cfg, "export.drafter", str(tmp_path)), "export.out", "o"), "export.format", "speculators")
    validate.validate_export(spec)
    fires(validate.validate_export, with_(spec, "target.model", "/no/target"), match="target.model=/no/target")
    fires(validate.validate_doctor, with_(cfg, "doctor.stages", ("disk", "dsik")),
          match="doctor.stages: unknown stage(s) dsik")


def test_target_groups_are_checked_before_loading(tmp_path):
    """Whole groups, disaggregated mode only, no fp8, and (from a local config.json) heads and MLP
    widths that the group size divides."""
    cfg = apply_overrides(recipes.get("tiny"), ["topology.mode=disaggregated", "topology.target_ranks=3",
                                                "topology.target_group_size=2"])
    assert validate.check_topology(cfg, 5) == [
        "topology.target_ranks=3 is not a whole number of target groups of topology.target_group_size=2: "
        "use topology.target_ranks=2 or 4"]
    four = with_(cfg, "topology.target_ranks", 4)
    assert validate.check_topology(four, 6) == []
    assert "needs topology.mode=disaggregated" in validate.check_topology(with_(cfg, "topology.mode", "colocated"), 1)[0]
    assert "target.precision=fp8 with topology.target_group_size>1" in \
        validate.check_topology(with_(four, "target.precision", "fp8"), 6)[0]
    (tmp_path / "config.json").write_text('{"num_attention_heads": 6, "num_key_value_heads": 3, '
                                          '"intermediate_size": 96}')
    local = with_(four, "target.model", str(tmp_path))
    assert validate.check_topology(local, 6) == [
        f"target {tmp_path}: num_key_value_heads=3 not divisible by topology.target_group_size=2: use a group "
        "size that divides the attention heads, the key/value heads and the MLP width"]
    # pipeline stages need no divisible widths, and fp8 layers are whole there; only enough layers
    staged = with_(local, "topology.target_parallel", "pipeline")
    assert validate.check_topology(staged, 6) == []
    assert validate.check_topology(with_(staged, "target.precision", "fp8"), 6) == []
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 1}')
    assert validate.check_topology(staged, 6) == [
        f"target {tmp_path}: 1 decoder layers cannot fill topology.target_group_size=2 pipeline stages: use a "
        "group size of at most 1"]


def test_prepare_in_target_groups_needs_whole_groups_and_torchrun_placement(tiny_qwen3_dir):
    cfg = apply_overrides(recipes.get("tiny"), [f"target.model={tiny_qwen3_dir}", "topology.target_group_size=2"])
    assert validate.torchrun_group_problems(cfg, 4) == []
    assert "does not divide the 3 prepare processes" in validate.torchrun_group_problems(cfg, 3)[0]
    placed = apply_overrides(cfg, ["topology.device=cuda:0"])
    assert "topology.device=cuda:0: under torchrun" in validate.torchrun_group_problems(placed, 4)[0]
    too_wide = apply_overrides(cfg, ["topology.target_group_size=4"])  # 2 key/value heads
    assert "num_key_value_heads=2" in validate.torchrun_group_problems(too_wide, 4)[0]
    assert "does not divide the 3 regenerate processes" in validate.torchrun_group_problems(cfg, 3, "regenerate")[0]
    staged = apply_overrides(cfg, ["topology.target_parallel=pipeline"])
    assert "`regenerate` shards its target by tensor parallelism only" in \
        validate.torchrun_group_problems(staged, 4, "regenerate")[0]


def test_a_target_directory_without_config_json_is_named_before_anything_loads(tmp_path, capsys):
    """Issue 39: such a directory failed with a tokenizer error."""
    from dflash_train import cli

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    assert cli.main(["train", "--recipe", "tiny", f"target.model={tmp_path / 'model'}",
                     f"train.out_dir={tmp_path / 'run'}"]) == 2
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "has no config.json" in last and str(tmp_path / "model") in last and not (tmp_path / "run").exists()
    (tmp_path / "model" / "m.Q4.gguf").write_bytes(b"GGUF")
    assert cli.main(["train", "--recipe", "tiny", f"target.model={tmp_path / 'model'}"]) == 2
    assert f"target.model={tmp_path / 'model' / 'm.Q4.gguf'}" in capsys.readouterr().out
