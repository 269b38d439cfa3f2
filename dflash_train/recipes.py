"""Named runs: Python functions that derive a RunConfig from the defaults in config.py.

Each recipe's docstring says how many tokens one optimizer step sees (sequence tokens, and the drafted
tokens the loss weighs: anchors x drafted slots per sequence) and why. The count matters most with
optim.name=muon: Muon's Newton-Schulz costs the same per optimizer step whatever the batch (~101
TFLOP at the paper's 8B shapes, more than a 1-sequence DSpark step's 36), so the larger the step's
batch, the smaller its share (docs/PERF.md, issue 37). Muon's default iteration is the Gram form of
torch's quintic (`optim.muon_iteration=gram`, config.py says why): ~79.5 TFLOP at those shapes."""

from __future__ import annotations

from dataclasses import replace

from dflash_train.config import ConfigError, RunConfig


def paper() -> RunConfig:
    """The paper's recipe (Qwen3 targets): 5 layers, block 16, 512 anchors, seq 3072, 6 epochs.

    Tokens per optimizer step: 8 sequences of up to 3,072 tokens (<= 24,576 sequence tokens; 8 x 512
    anchors x 15 drafted slots = 61,440 weighted rows), one sequence per micro-batch. Why: the paper
    gives no batch; SpecForge's mirror of it steps on 32 sequences over 8 GPUs, and 8 is the most that
    keeps a single 8B-shaped drafter GPU at one sequence per forward (the paper shapes' step, docs/PERF.md)
    while one optimizer step (AdamW: 1.5 ms; Muon: its Newton-Schulz) serves 8 forwards."""
    return RunConfig()


def default() -> RunConfig:
    """The embedded CPU quickstart: SmolLM2-135M-Instruct target, chitchat + assistant-style
    prompts with target-regenerated responses, a small drafter at the target's width, a
    wall-clock budget, then real speculative decoding on held-out prompts.

    Sized by measurement on a 2-core CPU (docs/LOG.md, 2026-12-01): regeneration at batch 64
    (~87 new tok/s vs ~29 at batch 8); block 4 with 80 anchors and a training softmax over the
    data's ~3K tokens (the lm_head was ~88% of a step); a small initial logit scale; lr 6e-3 with
    the cosine following the 10-minute budget (3e-3 and 1.2e-2 were worse at equal steps, session 11);
    4 sequences per step, i.e. ~580 steps where 8 made 288 in the same 10 minutes (session 11: held-out
    simulated tau 1.771 vs 1.65, real tau 1.43 / 1.96 vs 1.40-1.42 / 1.89-1.93; 1 layer instead of 2: no gain).
    600 prompts where there were 300 (session 19, a 2-core AMX Xeon, 8 epochs either way): 300 stopped at 584
    steps in ~4 of the 10 minutes and its best checkpoint came at step 380 (it had begun to memorise); 600 train
    1,128 steps in ~9.5 minutes, held-out simulated tau 2.03 vs 1.71, real tau assistant 1.48 vs 1.40 and
    chit-chat 2.07 vs 1.75, speedup 0.98x / 1.35x vs 0.92x / 1.12x on that box (docs/LOG.md).

    Tokens per optimizer step: 4 sequences of up to 320 tokens (<= 1,280 sequence tokens; 4 x 80 anchors
    x 3 drafted slots = 960 weighted rows): on a CPU the step count in a fixed budget mattered more than
    the batch (the session-11 comparison above).

    A held-out eval every 60 steps, not 20 (session 29, a 2-core box, the two arms side by side on one core
    each, 24 prompts a set): each eval takes 4-6 s of the 10 minutes, and 8 of them left 436 steps where 18
    left 360; real tau assistant 1.413 vs 1.376 (+0.036 [+0.012, +0.065]), chit-chat 1.963 vs 1.867 (+0.096
    [+0.032, +0.165]), paired over prompts. Checkpoints stay every 20 steps (written beside the training)."""
    base = RunConfig()
    return replace(
        base,
        drafter=replace(base.drafter, num_layers=2, block_size=4, init_norm_scale=0.25),
        data=replace(base.data, max_len=320, max_samples=600, regen_max_new_tokens=96, regen_batch_size=64,
                     eval_fraction=0.05),
        loss=replace(base.loss, train_vocab=4096),
        train=replace(base.train, out_dir="runs/default", epochs=8, seqs_per_step=4, num_anchors=80,
                      max_minutes=10.0, log_every=5, eval_every=60, ckpt_every=20),
        optim=replace(base.optim, lr=6e-3),
        eval=replace(base.eval, num_prompts=8, max_new_tokens=64),
    )


def gpu() -> RunConfig:
    """The default's target on one GPU in about 6 minutes end to end: 15,000 prompts (6,000 of the default
    corpus, 3,000 code requests built from the stdlib's functions, 6,000 written by the target itself:
    data.train=default:0.4,code:0.2,synthesize:0.4), generated at batch 1024; a 6-layer DSpark
    drafter (Markov bias and confidence head, drafting from the anchor's slot too) trained with
    DSpark's 0.1 CE + 0.9 TV loss, D-PACE position weights, Muon for its matrices and the whole
    vocabulary; block 8 (DSpark's published block) with 40 anchors per sequence; 32 sequences per step in
    one micro-batch; a 3.5-minute training budget; eval on four domains.

    Code requests (docs/LOG.md, session 21; one H100, the two runs back to back on one machine, equal 3.5 training
    minutes, 24 prompts per set), against default:0.5,synthesize:0.5: real tau HumanEval 2.958 vs 1.901,
    chit-chat 4.069 vs 3.867, assistant 1.958 vs 2.055, self-written 2.875 vs 3.068, outside requests 2.381 vs
    2.436, outside chit-chat 2.994 vs 3.026 (3,372 and 3,721 steps). Code was the one domain with no training
    data; the 3,000 requests it took came from the assistant, chit-chat and self-written shares.

    The Markov head (docs/LOG.md, session 26; one H100, three runs back to back on the same data, 3.5 training
    minutes, 24 prompts per set): `drafter.markov_head_type=gated` against this vanilla head drafted +0.04..+0.12 more
    on all six sets (2.837 vs 2.755 over the 144 prompts) with 4 % more steps and a lower held-out simulated tau (one
    seed); `rnn` drafted less on four sets. vLLM builds only the vanilla head, so the recipe keeps it; on SGLang
    `gated` may be worth its override.

    Block 8 (docs/LOG.md, session 18; one run on an H100 against session 17's block 4 on an H200, equal data
    and 3.5 training minutes, 24 prompts per set): real tau assistant 2.055 vs 2.075, chit-chat 3.926 vs 3.284,
    HumanEval 1.836 vs 1.917, self-written 2.996 vs 2.755, outside requests 2.376 vs 2.381, outside chit-chat
    3.041 vs 2.880; held-out simulated tau 3.645 vs 3.099, with 3,371 steps on the slower card against 3,701.
    Block 4 capped chit-chat (3.56 of 4 per anchor); at 8 the rows per step stay equal (40 x 8 = 80 x 4).
    Not yet rerun side by side on one card.

    Measured on one H200 (docs/LOG.md, session 13: seven arms on the same data at 1000 equal steps,
    24 held-out prompts per domain): against this recipe's DFlash of session 12 (decay weights, AdamW,
    a 22K-token training softmax, the KL + CE mix), D-PACE, Muon and the whole vocabulary each moved
    real tau by -0.03..+0.08 per domain (all three together: assistant +0.04, chit-chat +0.05,
    HumanEval +0.04, self-written +0.09); on top of them DSpark drafted the most (held-out simulated
    tau 2.83 vs 2.54; chit-chat +0.44 per prompt) and DFlash 2 less (2.64), so DSpark is the default.

    Measured on one H200 (docs/LOG.md, session 10, one timed run of 514 s): synthesis 15 s and
    regeneration 37 s through the fixed-shape CUDA-graph decoder, 2451 steps, held-out simulated tau
    2.63; real tau assistant 1.91, chit-chat 2.95, HumanEval 1.71, self-written 2.45 (session 8 with
    2.75 minutes: 2356 steps, 1.94 / 2.93 / 1.69 / 2.45). One micro-batch per step (not 32 passes of
    one sequence) made a step 8x faster; with the steps no longer scarce, the drafter memorised 5000
    samples (training batches 3.9 vs held-out 2.06), and more data and layers were what moved tau
    (2 layers/5K 1.62/2.50 -> 4/10K 1.84/2.91 -> 6/15K).

    Tokens per optimizer step: 32 sequences of up to 320 tokens (<= 10,240 sequence tokens; 32 x 40
    anchors x 8 drafted slots (DSpark: block 8 drafts 8) = 10,240 weighted rows) in one micro-batch. Why:
    one micro-batch of 32 made a step 8x faster than 32 of one (session 10), and at this drafter's
    576-wide matrices Muon's Newton-Schulz is small against a 32-sequence step; fewer sequences per step
    would buy more steps in the 3.5-minute budget, but the session-13 arms were measured at 32."""
    base = default()
    return replace(
        base,
        drafter=replace(base.drafter, num_layers=6, arch="dspark", block_size=8),
        data=replace(base.data, train="default:0.4,code:0.2,synthesize:0.4", max_samples=15000, regen_batch_size=1024,
                     synth_batch_size=1024),
        loss=replace(base.loss, kind="tv", train_vocab=None),
        optim=replace(base.optim, name="muon"),
        train=replace(base.train, out_dir="runs/gpu", epochs=30, seqs_per_step=32, micro_batch=32, num_anchors=40,
                      max_minutes=3.5, eval_every=500, ckpt_every=500),
        eval=replace(base.eval, prompts="assistant,chitchat,humaneval,synthesized"),
    )


def gpu_long() -> RunConfig:
    """The best drafter one GPU gives in about half an hour end to end: the `gpu` recipe with three times the
    prompts (45,000: the default corpus's 9,000, 3,150 code requests and 32,850 written by the target itself)
    and 20 training minutes; eval on the same four domains.

    Measured on one H100 (docs/LOG.md, session 29) with 30,000 prompts (the device session's budget left no
    room for 45,000): synthesis of 18,000 in 41 s, regeneration + taps of 30,000 in 56 s (46K new tok/s), the
    31 GB tapped file written and hashed in ~26 s, moved to the GPU in 6 s; training from 197 s, 23 steps/s;
    the eval of 6 sets x 24 prompts in 62 s; 1,398 s in all. On 30,000 prompts the 30 epochs ended the run at
    19.0 of its 20 minutes (26,580 steps) and the held-out tau peaked at 85 % of them: the 45,000 here give
    ~21 epochs in the minutes. Scaled from those rates (an estimate, not measured), this recipe trains from
    ~280 s and ends at ~26 minutes. The regenerate + tap cache holds ~1 MB per sample: 47 GB here, on the
    64 GiB disk of a one-GPU machine, and the taps stay in host memory on an 80 GB card (data.taps_device=auto:
    over 60 % of its free memory). bench/curve.py measures it as the 20-minute point of the recipe's curve (3.5, 10 and 20 minutes);
    `bench/gpu_stage.sh bg` runs it detached from the device calls."""
    base = gpu()
    return replace(
        base,
        data=replace(base.data, train="default:0.2,code:0.07,synthesize:0.73", max_samples=45000),
        train=replace(base.train, out_dir="runs/gpu_long", max_minutes=20.0),
    )


def tiny() -> RunConfig:
    """A few-step smoke run (tests, CI): tiny data, 1 layer, block 4.

    Tokens per optimizer step: 4 sequences of up to 128 tokens (4 x 8 anchors x 3 drafted slots = 96
    weighted rows): the smallest step that still exercises gradient accumulation where a test asks for it."""
    base = default()
    return replace(
        base,
        drafter=replace(base.drafter, num_layers=1, block_size=4),
        data=replace(base.data, max_samples=24, max_len=128, regen_max_new_tokens=24, regen_batch_size=8,
                     eval_fraction=0.2),
        train=replace(base.train, out_dir="runs/tiny", epochs=1, max_steps=4, max_minutes=None, seqs_per_step=4,
                      num_anchors=8, log_every=1, eval_every=2, ckpt_every=2, tensorboard=False),
        eval=replace(base.eval, num_prompts=2, max_new_tokens=16, sim_anchors_per_seq=8),
    )


RECIPES = {"default": default, "gpu": gpu, "gpu_long": gpu_long, "paper": paper, "tiny": tiny}


def get(name: str) -> RunConfig:
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}")
    return RECIPES[name]()
