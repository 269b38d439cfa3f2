"""Checks of a whole resolved config, and of the topology for training, before any model or data is
loaded: a bad setting fails at once (not after the target has loaded eight times), with every
problem found listed, each naming its `section.field` and the fix.

`validate_config` checks what any command reads (allowed values, positive sizes, fractions); the
per-command functions add what that command needs (a field that must be set, a file that must
exist); `validate_run` adds the training run's topology and batch arithmetic. Nothing here touches a
device (the doctor's parent process runs these too); torch is imported with the config tree, whose
drafter section takes its head settings from the head files (model/drafter/heads/architectures.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_train.config import RESUME_CHANGEABLE, ConfigError, RunConfig, block_size_of
from dflash_train.model.drafter.heads.architectures import setting_problems
from dflash_train.overrides import allowed_values, settings
from dflash_train.data import code_requests
from dflash_train.data.train_spec import CODE, parse_train_spec
from dflash_train.diagnostics.doctor import STAGE_KINDS

if TYPE_CHECKING:  # only for the annotation: topology.py imports torch
    from dflash_train.train.parallel.topology import Topology

BUILTIN_TARGETS = ("smollm2",)

# Fields that must be > 0 (when set: None keeps its meaning).
POSITIVE = (
    "drafter.num_layers", "drafter.num_taps", "drafter.sliding_window", "drafter.init_norm_scale",
    "data.max_len", "data.max_samples", "data.text_prompt_tokens", "data.regen_max_new_tokens", "data.regen_batch_size", "data.shard_mb",
    "data.prepare_batch_tokens", "loss.gamma", "loss.chunk_tokens", "loss.train_vocab", "loss.temperature",
    "optim.lr", "train.epochs", "train.max_steps", "train.max_minutes", "train.num_anchors", "train.seqs_per_step",
    "train.micro_batch", "train.log_every", "train.eval_every", "train.ckpt_every", "train.keep_last",
    "train.watchdog_seconds", "topology.target_ranks", "topology.target_group_size", "topology.max_in_flight",
    "eval.max_new_tokens", "eval.sim_anchors_per_seq", "eval.block_size", "doctor.stage_timeout", "plan.gpus", "plan.gpu_memory_gib",
    "optim.muon_ns_steps",
)
# Fields that must be >= 0 (when set).
NON_NEGATIVE = (
    "drafter.mask_token_id", "loss.head_weight", "data.min_loss_tokens", "data.regen_temperature", "optim.weight_decay",
    "optim.grad_clip", "eval.num_prompts", "eval.temperature", "eval.near_tie_gap", "eval.near_tie_gap_float32",
    "optim.muon_weight_decay", "train.profile_steps",
)
# Fields in a half-open [low, high) or closed [low, high] range: key -> (low, high, closed).
RANGES = {
    "data.eval_fraction": (0.0, 1.0, False),
    "optim.warmup_ratio": (0.0, 1.0, False),
    "optim.min_lr_ratio": (0.0, 1.0, True),
    "optim.muon_momentum": (0.0, 1.0, False),
    "loss.kl_weight": (0.0, 1.0, True),
    "loss.tv_weight": (0.0, 1.0, True),
}


def _fail(problems: list[str]) -> None:
    """Raise one ConfigError listing every problem (one is the common case)."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} config problems: " + "; ".join(problems))


def config_problems(cfg: RunConfig) -> list[str]:
    """What is wrong with any field, whatever the command: allowed values, signs, ranges."""
    problems = []
    for key, value, tp in settings(cfg):
        choices = allowed_values(tp)
        if choices is not None and value is not None and value not in choices:
            problems.append(f"{key}={value!r}: expected one of {', '.join(choices)}")
        elif value is None or isinstance(value, bool):
            continue
        elif key in POSITIVE and value <= 0:
            problems.append(f"{key}={value}: must be > 0")
        elif key in NON_NEGATIVE and value < 0:
            problems.append(f"{key}={value}: must be >= 0")
        elif key in RANGES:
            low, high, closed = RANGES[key]
            if not (low <= value <= high if closed else low <= value < high):
                problems.append(f"{key}={value}: must be in [{low}, {high}{']' if closed else ')'}")
    heads = [f"drafter.{problem}" for problem in setting_problems(cfg.drafter)]  # each head's own checks
    problems += [problem for problem in heads if problem not in problems]  # a Literal's is already named
    if block_size_of(cfg.drafter) < 2:
        problems.append(f"drafter.block_size={block_size_of(cfg.drafter)}: must be >= 2 (slot 0 is the anchor, "
                        "the drafter predicts slots 1..block_size-1)")
    if cfg.drafter.sliding_window is not None and cfg.drafter.sliding_window < block_size_of(cfg.drafter):
        problems.append(f"drafter.sliding_window={cfg.drafter.sliding_window}: must be >= drafter.block_size="
                        f"{block_size_of(cfg.drafter)} (a block's slots must see each other), or none for full attention")
    if not 0 < cfg.loss.dpace_alpha <= 1:
        problems.append(f"loss.dpace_alpha={cfg.loss.dpace_alpha}: must be in (0, 1] (D-PACE's q~ = (1 - alpha) q + alpha)")
    if cfg.loss.weighting == "dpace" and cfg.loss.gamma is not None:
        problems.append(f"loss.gamma={cfg.loss.gamma} with loss.weighting=dpace: D-PACE replaces the decay, so gamma "
                        "would be ignored; set one or the other")
    if cfg.eval.block_size is not None and cfg.eval.block_size < 2:
        problems.append(f"eval.block_size={cfg.eval.block_size}: must be >= 2")
    beta1, beta2 = cfg.optim.betas
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        problems.append(f"optim.betas={cfg.optim.betas}: both must be in [0, 1)")
    if cfg.optim.muon_ns_steps >= 100:
        problems.append(f"optim.muon_ns_steps={cfg.optim.muon_ns_steps}: must be < 100 (torch.optim.Muon's bound)")
    if not 0 < cfg.optim.muon_polar_lower < 1:
        problems.append(f"optim.muon_polar_lower={cfg.optim.muon_polar_lower}: must be in (0, 1) (the smallest "
                        "normalised singular value a Polar Express schedule is made for)")
    if cfg.optim.muon_iteration == "gram_symmetric" and not 2 <= cfg.optim.muon_gram_blocks <= 32:
        problems.append(f"optim.muon_gram_blocks={cfg.optim.muon_gram_blocks} with optim.muon_iteration="
                        "gram_symmetric: must be in 2..32 (block rows of its symmetric products; 1 block is optim.muon_iteration=gram)")
    if cfg.target.layer_ids is not None and (min(cfg.target.layer_ids, default=0) < 0 or not cfg.target.layer_ids):
        problems.append(f"target.layer_ids={cfg.target.layer_ids}: expected non-negative layer indices")
    unknown = [part for part in cfg.train.allow_changed if part not in RESUME_CHANGEABLE]
    if unknown:
        problems.append(f"train.allow_changed={','.join(cfg.train.allow_changed)}: {unknown} not among "
                        f"{','.join(RESUME_CHANGEABLE)}")
    if cfg.train.max_bad_steps < 1:
        problems.append(f"train.max_bad_steps={cfg.train.max_bad_steps}: must be >= 1")
    return problems


def validate_config(cfg: RunConfig) -> None:
    _fail(config_problems(cfg))


# ---------------------------------------------------------------------------------------------
# Files and required fields


def _looks_local(model: str) -> bool:
    """A target spec meant as a local path (a hub id is `org/name`: one slash, no leading dot)."""
    return model.startswith(("/", ".", "~")) or model.endswith(".gguf") or model.count("/") >= 2


def target_problems(cfg: RunConfig) -> list[str]:
    model, gguf = cfg.target.model, cfg.target.gguf_file
    if model in BUILTIN_TARGETS:
        return []
    path = Path(model).expanduser()
    if _looks_local(model) and not path.exists():
        return [f"target.model={model}: no such file or directory (expected smollm2, a local HF directory, "
                "an already-cached hub id or a .gguf file)"]
    if gguf is not None and path.is_dir() and not (path / gguf).is_file():
        return [f"target.gguf_file={gguf}: not found in {path}"]
    if gguf is None and path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = (f"; it holds {', '.join(ggufs[:3])}: give target.model={path / ggufs[0]}" if ggufs else
                ": an HF model directory holds config.json, the tokenizer and the weights (save_pretrained)")
        return [f"target.model={model}: {path} has no config.json, so it is no model directory{hint}"]
    return []


def data_problems(cfg: RunConfig) -> list[str]:
    """data.train: one source or a weighted mix of sources (data/train_spec.py), each existing."""
    try:
        sources = parse_train_spec(cfg.data.train, cfg.data.max_samples)
    except ValueError as e:
        return [str(e)]
    if any(name == CODE for name, _ in sources) and not code_requests.has_sources():
        return [f"data.train={cfg.data.train}: source 'code' builds its requests from this Python's standard-library "
                f"sources, and {code_requests.stdlib_dir()} holds none (a slim image that ships only bytecode); "
                "install them (e.g. the distribution's python3 full/stdlib package) or drop the source"]
    return []


def _required(cfg: RunConfig, key: str, what: str) -> list[str]:
    section, name = key.split(".")
    return [] if getattr(getattr(cfg, section), name) is not None else [f"{key} is not set: {what} ({key}=...)"]


def _drafter_dir_problems(key: str, value: str | None, draft_vocab: bool = False) -> list[str]:
    """A z-lab drafter directory; with `draft_vocab`, its draft vocabulary too (read by the eval and the export):
    draft_vocab.json, or the engines' reduced form (config.json `draft_vocab_size`, `d2t` in the weights)."""
    if value is None:
        return []
    config = Path(value).expanduser() / "config.json"
    if not config.is_file():
        return [f"{key}={value}: no config.json there: not a z-lab drafter directory (a training run's "
                "`drafter/`, or a published DFlash drafter)"]
    if not draft_vocab or not _declares_draft_vocab(config):
        return []
    from dflash_train.model.drafter.export.draft_vocab import load_draft_vocab  # local: torch is heavy for validation

    try:  # a malformed draft vocabulary fails here, not after the target has loaded
        load_draft_vocab(config.parent, int(json.loads(config.read_text()).get("vocab_size") or 2**62))
    except (ValueError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        return [f"{key}={value}: {e}"]
    return []


def _declares_draft_vocab(config: Path) -> bool:
    """A draft_vocab.json beside config.json, or a z-lab config.json declaring a reduced `draft_vocab_size` (a
    speculators config records no vocabulary of its own: its draft vocabulary is read when the drafter loads)."""
    try:
        d = json.loads(config.read_text())
    except ValueError:
        return False  # named by the loader, with the file
    reduced = isinstance(d, dict) and d.get("vocab_size") is not None and d.get("draft_vocab_size") not in (
        None, d.get("vocab_size"))
    return (config.parent / "draft_vocab.json").is_file() or reduced


def _ecosystem_problems(key: str, value: str | None) -> list[str]:
    """A z-lab, speculators or DeepSpec drafter config our classes read (model/drafter/export/ecosystem.py; no torch)."""
    if value is None or not (Path(value).expanduser() / "config.json").is_file():
        return []  # said by _drafter_dir_problems
    from dflash_train.model.drafter.export.ecosystem import config_problems

    return [f"{key}={value}: {problem}" for problem in config_problems(value)]


def _prompt_set_problems(spec: str | None) -> list[str]:
    """eval.prompts names sets (chitchat, assistant, humaneval, ...) and JSONL paths."""
    # local: the prompt-set module reads the data package (torch, tokenizers); validation stays light
    from dflash_train.eval.prompt_sets import resolve_prompt_sets

    try:
        resolve_prompt_sets(spec)
    except (ValueError, FileNotFoundError) as e:
        return [f"eval.prompts={spec}: {e}"]
    return []


def _file_problems(key: str, value: str | None) -> list[str]:
    if value is not None and not Path(value).expanduser().exists():
        return [f"{key}={value}: no such file or directory"]
    return []


# ---------------------------------------------------------------------------------------------
# Per command


def check_topology(cfg: RunConfig, world_size: int) -> list[str]:
    """The topology settings against the number of processes (before a Topology is built)."""
    mode, targets = cfg.topology.mode, cfg.topology.target_ranks
    if mode != "disaggregated":
        if cfg.topology.target_group_size != 1:
            return [f"topology.target_group_size={cfg.topology.target_group_size} needs topology.mode=disaggregated "
                    "(target groups are target ranks); set topology.target_group_size=1"]
        return []
    if world_size < 2:
        return ["topology.mode=disaggregated needs at least 2 processes (1 target + 1 drafter rank): run under "
                "torchrun --nproc-per-node=N, or use topology.mode=colocated"]
    if not 1 <= targets < world_size:
        return [f"topology.target_ranks={targets} leaves no drafter rank in a world of {world_size} processes: "
                f"use topology.target_ranks=1..{world_size - 1}"]
    return target_group_problems(cfg)


def target_group_problems(cfg: RunConfig) -> list[str]:
    """Target groups (tensor-parallel targets): whole groups, a shardable target, before loading it."""
    size, targets = cfg.topology.target_group_size, cfg.topology.target_ranks
    if size <= 1:
        return []
    if targets % size:
        fits = [n for n in range(size, targets + size + 1, size)][-2:]
        return [f"topology.target_ranks={targets} is not a whole number of target groups of "
                f"topology.target_group_size={size}: use topology.target_ranks={' or '.join(map(str, fits))}"]
    if cfg.topology.target_parallel == "pipeline":
        return _stage_count_problems(cfg.target.model, size)
    if cfg.target.precision == "fp8":
        return ["target.precision=fp8 with topology.target_group_size>1 is not supported (float8 layers are not "
                "sharded): use target.precision=bf16, topology.target_parallel=pipeline or topology.target_group_size=1"]
    return _target_width_problems(cfg.target.model, size)


def _local_text_config(model: str) -> dict | None:
    config_file = Path(model).expanduser() / "config.json"
    if not config_file.is_file():
        return None
    text = json.loads(config_file.read_text())
    return text.get("text_config", text)


def _stage_count_problems(model: str, size: int) -> list[str]:
    """Pipeline stages hold at least one decoder layer each (from a local config.json; a GGUF or
    hub-cache target is checked when its stage is cut, `model/target/pipeline_stages.py`)."""
    layers = (_local_text_config(model) or {}).get("num_hidden_layers")
    if layers is None or layers >= size:
        return []
    return [f"target {model}: {layers} decoder layers cannot fill topology.target_group_size={size} pipeline "
            f"stages: use a group size of at most {layers}"]


def _target_width_problems(model: str, size: int) -> list[str]:
    """Heads and intermediate sizes against the group size, read from a local config.json (no
    weights); a GGUF or hub-cache target is checked right after loading instead (shard_target)."""
    text = _local_text_config(model)
    if text is None:
        return []
    from dflash_train.model.target.tensor_parallel import indivisible_widths  # torch.distributed only, no weights

    bad = [f"{k}={n}" for k, n in indivisible_widths(text, size).items()]
    if not bad:
        return []
    return [f"target {model}: {', '.join(bad)} not divisible by topology.target_group_size={size}: use a group "
            "size that divides the attention heads, the key/value heads and the MLP width"]


def batch_problems(cfg: RunConfig, num_drafters: int) -> list[str]:
    """seqs_per_step must split evenly over drafter ranks and micro-batches; name the nearest fixes."""
    seqs, micro = cfg.train.seqs_per_step, cfg.train.micro_batch
    per_step = micro * num_drafters
    if seqs <= 0 or micro <= 0 or seqs % per_step == 0:
        return []
    below, above = seqs // per_step * per_step, (seqs // per_step + 1) * per_step
    nearest = "train.seqs_per_step=" + " or ".join(str(v) for v in (below, above) if v > 0)
    return [f"train.seqs_per_step={seqs} is not a multiple of train.micro_batch ({micro}) x drafter ranks "
            f"({num_drafters}) = {per_step}: use {nearest}"]


def validate_run(cfg: RunConfig, topo: "Topology") -> None:
    """Everything a training run can check before loading the target (cheap: every rank runs it)."""
    problems = config_problems(cfg) + check_topology(cfg, topo.world_size) + batch_problems(cfg, topo.num_drafters)
    if cfg.topology.mode == "disaggregated" and cfg.train.max_minutes:
        problems.append("train.max_minutes needs topology.mode=colocated or offline: target ranks must know the "
                        "step count in advance; set train.max_minutes=none and train.max_steps=N instead")
    if cfg.topology.device is not None:
        problems.append(f"topology.device={cfg.topology.device}: train places each rank itself (cuda:LOCAL_RANK "
                        "or the CPU); set CUDA_VISIBLE_DEVICES instead and leave topology.device=none")
    if cfg.data.max_samples is not None and cfg.data.max_samples < cfg.train.seqs_per_step:
        problems.append(f"data.max_samples={cfg.data.max_samples} cannot fill one step of train.seqs_per_step="
                        f"{cfg.train.seqs_per_step} sequences: raise data.max_samples or lower train.seqs_per_step")
    problems += _run_input_problems(cfg) + precision_problems(cfg) + graph_problems(cfg, topo.num_drafters)
    _fail(problems)


def graph_problems(cfg: RunConfig, num_drafters: int) -> list[str]:
    """train.compile_mode=reduce-overhead replays one recorded forward and backward per step: a second micro-batch
    would overwrite the first one's gradients before they are summed."""
    if cfg.train.compile_mode != "reduce-overhead":
        return []
    problems = []
    if cfg.train.compile == "off":
        problems.append("train.compile_mode=reduce-overhead with train.compile=off: CUDA graphs replay a compiled "
                        "step; set train.compile=auto or on, or train.compile_mode=default")
    accum = cfg.train.seqs_per_step // max(1, cfg.train.micro_batch * num_drafters)
    if accum > 1:
        problems.append(f"train.compile_mode=reduce-overhead with {accum} micro-batches per step "
                        f"(train.seqs_per_step={cfg.train.seqs_per_step} / train.micro_batch={cfg.train.micro_batch}"
                        f" / {num_drafters} drafter rank(s)): CUDA graphs need one; set train.micro_batch="
                        f"{cfg.train.seqs_per_step // num_drafters} or train.compile_mode=default")
    return problems


def precision_problems(cfg: RunConfig) -> list[str]:
    """train.precision / target.precision = fp8 need torchao and a CUDA GPU of compute capability
    >= 8.9; checked here, before the target loads."""
    options = [key for key, value in (("train.precision", cfg.train.precision),
                                      ("target.precision", cfg.target.precision)) if value == "fp8"]
    problems = []
    if cfg.train.fp8_lm_head and cfg.train.precision == "bf16":
        problems.append("train.fp8_lm_head=true: the lm_head runs in float8 only when the drafter does "
                        "(train.precision=fp8, or auto where it picks fp8)")
    if not options:
        return problems
    # local: dflash_train.fp8 imports torch, which this module avoids (the doctor's parent runs it)
    from dflash_train.fp8 import fp8_problem

    problem = fp8_problem(None)  # the current CUDA device (the GPUs of one job are alike), else the CPU
    return problems + ([f"{key}=fp8: {problem}; set {key}=bf16 to run without FP8" for key in options]
                       if problem else [])


def _run_input_problems(cfg: RunConfig) -> list[str]:
    if cfg.topology.mode == "offline":
        shards = cfg.data.shards
        if not shards:
            return ["topology.mode=offline needs data.shards=DIR (written by `dflash-train prepare`)"]
        if not (Path(shards).expanduser() / "index.json").is_file():
            return [f"data.shards={shards}: no index.json there; write the shards with `dflash-train prepare "
                    f"--out {shards}` first"]
        return target_problems(cfg)
    return target_problems(cfg) + data_problems(cfg) + _prompt_set_problems(cfg.eval.prompts)


def validate_eval(cfg: RunConfig) -> None:
    _fail(config_problems(cfg) + _required(cfg, "eval.drafter", "the drafter directory to measure")
          + _drafter_dir_problems("eval.drafter", cfg.eval.drafter, draft_vocab=cfg.eval.draft_vocab != "full")
          + _ecosystem_problems("eval.drafter", cfg.eval.drafter)
          + target_problems(cfg)
          + _prompt_set_problems(cfg.eval.prompts))


def validate_regenerate(cfg: RunConfig) -> None:
    _fail(config_problems(cfg) + _required(cfg, "data.regen_out", "the JSONL to write the responses to")
          + torchrun_group_problems(cfg, int(os.environ.get("WORLD_SIZE", "1")), "regenerate")
          + target_problems(cfg) + data_problems(cfg))


def validate_prepare(cfg: RunConfig) -> None:
    problems = config_problems(cfg) + _required(cfg, "data.shards", "the directory to write the shards to")
    if cfg.data.train == "default":
        problems.append("data.train=default holds prompts only (no assistant turns to tap): run `dflash-train "
                        "regenerate --out regenerated.jsonl` first and prepare from data.train=regenerated.jsonl")
    _fail(problems + torchrun_group_problems(cfg, int(os.environ.get("WORLD_SIZE", "1"))) + target_problems(cfg)
          + data_problems(cfg))


def torchrun_group_problems(cfg: RunConfig, world_size: int, command: str = "prepare") -> list[str]:
    """`prepare` or `regenerate` under torchrun: whole target groups, each process placed by torchrun."""
    size = cfg.topology.target_group_size
    if size < 1 or world_size % size:
        return [f"topology.target_group_size={size} does not divide the {world_size} {command} processes: use a "
                f"divisor of {world_size}, or run torchrun with a multiple of {size} processes"]
    if world_size > 1 and cfg.topology.device is not None:
        return [f"topology.device={cfg.topology.device}: under torchrun each process takes cuda:LOCAL_RANK or the "
                "CPU; set CUDA_VISIBLE_DEVICES instead and leave topology.device=none"]
    if size > 1 and cfg.topology.target_parallel == "pipeline":
        return [f"topology.target_parallel=pipeline: `{command}` shards its target by tensor parallelism only "
                "(pipeline stages serve training's taps); use topology.target_parallel=tensor, or "
                "topology.target_group_size=1 on devices that hold the target"]
    return _target_width_problems(cfg.target.model, size) if size > 1 else []


def validate_check(cfg: RunConfig) -> None:
    _fail(config_problems(cfg) + _required(cfg, "check.drafter", "the exported drafter directory to check")
          + _drafter_dir_problems("check.drafter", cfg.check.drafter) + target_problems(cfg))


def validate_export(cfg: RunConfig) -> None:
    problems = config_problems(cfg) + _required(cfg, "export.drafter", "the z-lab drafter directory to export")
    problems += _required(cfg, "export.out", "the output directory")
    problems += _drafter_dir_problems("export.drafter", cfg.export.drafter, draft_vocab=cfg.export.format == "zlab")
    if cfg.export.format == "speculators":  # stores the target's embedding and lm_head
        problems += target_problems(cfg)
    _fail(problems)


def validate_doctor(cfg: RunConfig) -> None:
    problems = config_problems(cfg)
    unknown = sorted(set(cfg.doctor.stages or ()) - set(STAGE_KINDS))
    if unknown:
        problems.append(f"doctor.stages: unknown stage(s) {', '.join(unknown)}; expected a subset of "
                        f"{','.join(STAGE_KINDS)}")
    if cfg.doctor.check_target:
        problems += target_problems(cfg)
    _fail(problems)


def validate_plan(cfg: RunConfig) -> None:
    """target.model is a shape name, an HF directory or a config.json (plan.py reads its config only)."""
    _fail(config_problems(cfg) + target_problems(cfg))


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it; a plain run is a world of one."""
    return int(os.environ.get("WORLD_SIZE", "1"))
