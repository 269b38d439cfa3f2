"""The compile prewarm's process: `python -m dflash_train.train.prewarm.worker`, a pickled `launch.PrewarmRequest` on
its stdin (launch.py starts it). It builds what the run's first step will compile, through the loop's own builders
(train/setup.py), runs that step on dummy batches so that inductor's on-disk caches hold the step's graphs, writes
its result and exits.

What a compiled step compiles, each keyed by shapes, dtypes and strides, never by values:
- the drafter's forward and backward (`setup.step_model`: torch.compile(dynamic=False) of the module; flex attention
  inside it on a GPU);
- the loss's chunk function (loss/softmax_rows.py `compiled_chunk`: one graph per chunk shape, whole blocks of about
  loss.chunk_tokens rows against the training softmax's rows of the lm_head);
- on CUDA the optimizer's elementwise updates (optim/optimizer.py MasterWeightAdamW, optim/muon.py: momentum,
  Nesterov stack, apply).
Their shapes follow from the config alone: a compiled step pads every micro-batch to data.max_len whatever its
samples' lengths (`setup.Kernels.pad_multiple`), each sequence carries train.num_anchors anchors, and
`setup.batch_plan` gives the micro-batches per rank; so the dummy batches are cut by the run's own `collate` from
samples of data.max_len tokens. Known only with the data: the training softmax's size where the data holds more
distinct tokens than loss.train_vocab (then the loss chunk compiles again in the first step, which says so).

Where it cannot build a rank's exact graphs: it runs one rank's step alone (no process group), so with several
drafter ranks the optimizer's float32 gradient sums (at accumulation 1) and Muon's per-rank share of the matrices
compile in each rank's first step; a target that computes taps every step (colocated, not stored) compiles its own
layers there too (they need the whole target).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
import threading
import time
import traceback

import torch

from dflash_train import atomic
from dflash_train.diagnostics.compile_health import GraphCacheCounts
from dflash_train.model.target.load import load_target
from dflash_train.model.target.subset import TargetSubset
from dflash_train.train import setup
from dflash_train.train.feed.batching import BatchPlan, MicroBatch, Sample
from dflash_train.train.feed.sources import CollateArgs
from dflash_train.train.feed.taps import TapsSpec, taps_spec
from dflash_train.train.step import train_step
from dflash_train.train.watch.health import HEALTH_WARMUP_STEPS

STEPS = HEALTH_WARMUP_STEPS  # the steps the compile-health watch lets a run compile in; nothing new after them
# Of the GPU's memory, the most the prewarm's allocator may hold: the run beside it loads the target and generates on
# the same GPU, and must never run out because of it (a prewarm that needs more fails, saying so, and the run goes
# on). The `gpu` recipe's step needs far less; a step at the paper's shapes may not fit and then is not prewarmed.
MEMORY_FRACTION = 0.25
FAILED = "failed: "  # the last line of a failed prewarm's log: "prewarm: failed: <exception>: <its first line>"


def say(message: str) -> None:
    print(f"prewarm: {message}", flush=True)


def dummy_samples(cfg, vocab_size: int) -> list[Sample]:
    """One step's sequences of data.max_len random tokens, supervised after the first: a compiled step pads every
    micro-batch to data.max_len whatever its samples' lengths. The tokens stay below loss.train_vocab, so that the
    training softmax takes its configured size (`setup.train_vocab_of`)."""
    gen = torch.Generator().manual_seed(cfg.train.seed)
    high, n = min(vocab_size, cfg.loss.train_vocab or vocab_size), cfg.data.max_len
    return [Sample(f"prewarm-{i}", tuple(torch.randint(0, high, (n,), generator=gen).tolist()), (0,) + (1,) * (n - 1))
            for i in range(cfg.train.seqs_per_step)]


def dummy_micro_batches(plan: BatchPlan, collate: CollateArgs, spec: TapsSpec, samples: list[Sample]
                        ) -> list[MicroBatch]:
    """A drafter rank's micro-batches of one step of `samples`, cut and padded by the run's own `collate`, with the
    target's tensors as stored taps reach the step (`TapsSpec.padded`: [b, S, width] in their dtype, contiguous)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for group in plan.for_drafter(list(range(len(samples))), 0):
        mb = collate([samples[i] for i in group], 0)
        rows = [{f.name: torch.randn(len(samples[i]), f.width, generator=gen).mul(0.1).to(f.dtype) for f in spec.fields}
                for i in group]
        mb.from_target = spec.padded(rows, mb.input_ids.shape[1])
        out.append(mb)
    return out


def widened(spec: TapsSpec) -> TapsSpec:
    """The bundle with taps one column too wide (FaultPlan "prewarm": a bad shape, to test the failure path)."""
    return TapsSpec(tuple(dataclasses.replace(f, width=f.width + 1) if f.name == "taps" else f for f in spec.fields))


def build(request):
    """(model, optimizer, scheduler, micro-batches, step context, grad clip) of one drafter rank's compiled step."""
    cfg, device = request.cfg, torch.device(request.device)
    say(f"the target's config, tokenizer, embedding and lm_head ({cfg.target.model})")
    target = load_target(cfg.target.model, cfg.target.gguf_file, cfg.target.dtype, device, cfg.target.trust_remote_code,
                         subset=TargetSubset())  # no decoder layers: the step reads the embedding and lm_head only
    dcfg = setup.build_drafter_config(cfg, target)
    kernels = setup.resolve_kernels(cfg, device, dcfg)
    spec = taps_spec(dcfg, target.dtype, final_hidden=cfg.loss.needs_target_hidden)
    samples = dummy_samples(cfg, target.vocab_size)
    mbs = dummy_micro_batches(setup.batch_plan(cfg, request.num_drafters), setup.collate_args(cfg, kernels),
                              widened(spec) if request.bad_shape else spec, samples)
    say(f"a random {dcfg.num_layers}-layer drafter x {dcfg.hidden_size} ({kernels.backend}, {kernels.precision[0]}); "
        f"{len(mbs)} micro-batch(es) of {tuple(mbs[0].input_ids.shape)} per step")
    drafter, optimizer, scheduler = setup.drafter_and_optimizer(cfg, dcfg, target, device, STEPS, from_target=False)
    vocab = setup.train_vocab_of(cfg, samples, target.vocab_size, say)
    ctx = setup.step_context(cfg, target, dcfg, drafter, vocab, kernels, device, None, 1, say)  # before the cast
    model = setup.step_model(drafter, optimizer, cfg, kernels, device, None, 1, say)
    return model, optimizer, scheduler, mbs, ctx, cfg.optim.grad_clip


def prewarm(request) -> dict:
    """Build the step and run it STEPS times; the result the run reads (launch.Prewarm.outcome)."""
    t0 = time.perf_counter()
    device = torch.device(request.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.set_per_process_memory_fraction(MEMORY_FRACTION, device)
    model, optimizer, scheduler, mbs, ctx, clip = build(request)
    built, before = time.perf_counter(), GraphCacheCounts.snapshot()
    for step in range(STEPS):
        train_step(model, optimizer, scheduler, mbs, ctx, clip, progress=step / STEPS)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's kernels ran (and were tuned) before it counts as done
        say(f"step {step + 1} of {STEPS} done, {time.perf_counter() - built:.1f} s since the drafter was built")
    graphs = GraphCacheCounts.snapshot() - before
    say(graphs.summary())
    end = time.perf_counter()
    return {"seconds": time.time() - request.launched_at, "build_s": built - t0, "steps_s": end - built,
            "steps": STEPS, "graphs": graphs.as_dict()}


def _named(e: BaseException) -> str:
    """'Type: first line' of `e`, and of the error it was raised from or while handling (Dynamo wraps the one it
    met, `from None`) where there is one."""
    root = e
    while (root.__cause__ or root.__context__) is not None:
        root = root.__cause__ or root.__context__

    def line(x: BaseException) -> str:
        return f"{type(x).__name__}: {(str(x).strip().splitlines() or [''])[0][:200]}"

    return line(e) if root is e else f"{line(e)} ({line(root)})"


def _exit_with(parent: int) -> None:
    """Exit once the run that started this process is gone (killed: nothing would wait for it). The thread only
    watches a pid; it compiles nothing (rule 1 of the house is about compiling in threads)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="prewarm-parent-watch", daemon=True).start()


NICENESS = 10
"""The worker and its compile workers yield the CPU to the run's own data phase. On a fresh H100 (docs/LOG.md, session
23) the `gpu` recipe's regeneration + taps ran at 17.5K new tok/s beside the prewarm against 42K without it (session 22,
another machine), so the data phase took ~44 s longer while the first step's compile (55 s before) vanished from the
training budget. Whether the CPU (16 cores against inductor's compile pool and the tap file's writing) or the shared GPU
caused it was not measured; a lower CPU priority costs the prewarm nothing where the cores are free."""


def main() -> None:
    """Exits at once (os._exit) once its result is written or it failed: an interpreter's teardown of inductor's
    compile workers would only keep the run waiting."""
    code = 1
    try:
        request = pickle.load(sys.stdin.buffer)
        _exit_with(os.getppid())
        niceness = os.nice(NICENESS)  # inherited by inductor's compile workers
        say(f"pid {os.getpid()}, nice {niceness}, device {request.device}, "
            f"inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR')}")
        atomic.write_text(request.result_path, json.dumps(prewarm(request)))
        code = 0
    except BaseException as e:  # noqa: BLE001 - every failure ends here, told in the log the run points to
        traceback.print_exc()
        say(FAILED + _named(e))  # the last line: what the run's one-line notice quotes
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
