"""`train(cfg)`: the one training loop. Read it top to bottom.

setup (topology, target, data, drafter, optimizer, resume) -> target ranks serve taps and return;
drafter ranks: while step < total: get taps -> step -> log / held-out simulated tau / checkpoint.
Then the final checkpoint, the z-lab export and, on a colocated main rank, real speculative
decoding on held-out prompts. Every process runs a watchdog; SIGTERM/SIGINT checkpoint and stop.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_train.config import RunConfig
from dflash_train.diagnostics.watchdog import Watchdog
from dflash_train.model.hf_format import load_zlab, save_zlab
from dflash_train.train import balance, setup
from dflash_train.train.balance import ComputeTimer
from dflash_train.train.batching import BatchPlan, StepSampler
from dflash_train.train.checkpoint import Checkpointer, provenance, rng_state, set_rng_state
from dflash_train.train.health import CompileHealthWatch
from dflash_train.train.loss import LossStats, summarize
from dflash_train.train.metrics import MetricsLog
from dflash_train.train.optim import TimeBudget, build_optimizer, full_precision_weights
from dflash_train.train.parallel import parallelize, resolve_backend, resolve_compile, use_shared_compile_cache
from dflash_train.train.sources import (CollateArgs, ColocatedSource, RemoteSource, StoredTapsSource, compute_taps,
                                        serve_taps)
from dflash_train.train.step import StepContext, forward_stats, reduce_stats, to_device, train_step
from dflash_train.train.topology import init_distributed, pick_device, topology_from_env

PAD_MULTIPLE = 64  # uncompiled runs pad lengths to this multiple; compiled runs pad to max_len (static)
AGREE_EVERY = 4  # several drafter ranks agree on stopping (signal, time budget) every this many steps
SETUP_WATCHDOG_S = 1800.0  # loading, data preparation and the first (compiling) step beat rarely
FAULT_ENV = "DFLASH_INJECT_FAULT"  # "raise|hang:rank=R:step=S", for testing failure handling


def inject_fault(rank: int, step: int) -> None:
    """Test hook: raise, or stall forever, on rank R after step S (see FAULT_ENV)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kind, *fields = spec.split(":")
    where = dict(f.split("=") for f in fields)
    if int(where.get("rank", -1)) == rank and int(where.get("step", -1)) == step:
        if kind == "hang":
            while True:
                time.sleep(3600)
        raise RuntimeError(f"injected fault ({FAULT_ENV}={spec})")


class StopFlag:
    """SIGTERM/SIGINT: inside the training loop (`deferring`), the loop checkpoints and stops at the
    next step boundary; anywhere else, or on a second signal, the process stops at once."""

    def __init__(self):
        self.signal = None
        self.deferring = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if not self.deferring or self.signal is not None:
            print(f"{name}: stopping now", flush=True)
            raise SystemExit(128 + signum)
        self.signal = name
        print(f"{name}: will checkpoint and stop after this step (again to stop at once)", flush=True)

    def __call__(self) -> bool:
        return self.signal is not None


def train(cfg: RunConfig) -> dict:
    topo = topology_from_env(cfg.topology.mode, cfg.topology.target_ranks)
    setup.validate_run(cfg, topo)
    device = pick_device(topo)
    dp_group = init_distributed(topo, device)
    out_dir = Path(cfg.train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    use_shared_compile_cache(out_dir.parent / ".compile-cache")
    log = _logger(topo)
    watchdog = Watchdog(max(cfg.train.watchdog_seconds, SETUP_WATCHDOG_S), name=f"rank{topo.rank}")
    watchdog.start()
    stop = StopFlag()
    try:
        return _run(cfg, topo, device, dp_group, out_dir, log, watchdog, stop)
    finally:
        watchdog.stop()


@dataclasses.dataclass
class Run:
    """What every rank knows once setup is done (plain data; built by `_prepare`)."""

    cfg: RunConfig
    topo: object
    device: torch.device
    dp_group: object
    out_dir: Path
    log: object
    watchdog: Watchdog
    stop: StopFlag
    target: object = None
    dcfg: object = None
    train_samples: list = None
    held_out: list = None
    stored_taps: object = None  # per train sample, when taps come from regeneration or shards
    held_out_taps: object = None
    plan: BatchPlan = None
    sampler: StepSampler = None
    total_steps: int = 0
    backend: str = "sdpa"
    compiled: bool = False
    collate_fn: object = None
    eval_mbs: list = None
    checkpointer: Checkpointer = None
    resume: tuple | None = None

    @property
    def layer_ids(self) -> list[int]:
        return list(self.dcfg.target_layer_ids)


def _run(cfg, topo, device, dp_group, out_dir, log, watchdog, stop) -> dict:
    run = _prepare(Run(cfg, topo, device, dp_group, out_dir, log, watchdog, stop))
    if topo.is_target:
        return _serve(run)
    return _train_drafter(run)


def _prepare(run: Run) -> Run:
    """Target, drafter config, samples (and taps where stored), batching, resume point."""
    from dflash_train.data.text import check_data_format
    from dflash_train.model.target import load_target

    cfg, topo = run.cfg, run.topo
    with run.watchdog.stage("load target"):
        run.target = load_target(cfg.target.model, cfg.target.gguf_file, cfg.target.dtype, run.device,
                                 cfg.target.trust_remote_code, check_tokenizer=lambda tok: check_data_format(
                                     cfg.data.format, tok, cfg.target.model, cfg.eval.num_prompts))
    run.dcfg = setup.build_drafter_config(cfg, run.target)
    with run.watchdog.stage("prepare data"):
        if topo.mode == "offline":
            (run.train_samples, run.stored_taps), (run.held_out, run.held_out_taps) = \
                setup.samples_from_shards(cfg, run.layer_ids, run.log)
        elif setup.taps_from_regeneration(cfg, topo):
            (run.train_samples, run.stored_taps), (run.held_out, run.held_out_taps) = setup.prepare_tapped(
                cfg, run.target, run.layer_ids, run.out_dir / "data", run.log, run.watchdog.beat)
        else:
            run.train_samples, run.held_out = setup.load_or_build_samples(
                cfg, run.target, topo, run.out_dir / "data", run.log, heartbeat=run.watchdog.beat)
    run.plan = BatchPlan(cfg.train.seqs_per_step, cfg.train.micro_batch, topo.num_drafters)
    run.sampler = StepSampler(len(run.train_samples), cfg.train.seqs_per_step, cfg.train.seed)
    run.total_steps = setup.total_steps_of(cfg, run.sampler.steps_per_epoch)
    run.backend = resolve_backend(cfg.train.attention, run.device)
    run.compiled = resolve_compile(cfg.train.compile, run.device)
    if run.compiled and run.stored_taps is None and topo.runs_target_forward:
        run.target.compile_layers()  # the target computes taps every step: fuse its elementwise work
    pad_multiple = cfg.data.max_len if run.compiled else PAD_MULTIPLE
    run.collate_fn = CollateArgs(cfg.train.seed, cfg.train.num_anchors, pad_multiple, cfg.data.max_len)
    run.eval_mbs = setup.eval_batches(run.held_out, cfg.eval.sim_anchors_per_seq, pad_multiple, cfg.data.max_len)
    run.checkpointer = Checkpointer(run.out_dir, cfg.train.keep_last)
    run.resume = _resume_point(cfg, topo, run.checkpointer)
    return run


def _balance_due(run: Run, step: int) -> bool:
    return (run.topo.mode == "disaggregated" and step == balance.BALANCE_STEP - 1
            and run.total_steps >= balance.BALANCE_STEP and run.resume is None)


def _serve(run: Run) -> dict:
    """A target rank: compute and send the taps of every micro-batch routed to it."""
    cfg, topo = run.cfg, run.topo
    timer = ComputeTimer(run.device)
    done = 0

    def on_timer(k: int, event: str, sequences: int) -> None:
        if balance.in_window(k):
            timer.start() if event == "start" else timer.stop(sequences)

    health = CompileHealthWatch(run.compiled, False, 0, run.log)

    def on_step(k: int) -> None:
        run.watchdog.timeout_s = cfg.train.watchdog_seconds
        inject_fault(topo.rank, k)
        health.after_step(k, last=k == run.total_steps - done)
        if _balance_due(run, k):
            balance.share_and_report("target", timer.seconds_per_sequence(), topo, run.log)

    if run.resume is not None:
        run.sampler.load_state_dict(run.resume[1]["data"])
        done = run.resume[1]["train"]["step"]
    _send_eval_taps(run.target, run.layer_ids, run.eval_mbs, topo, run.device)
    stats = serve_taps(run.target, run.layer_ids, run.train_samples, run.sampler, run.plan, topo, run.collate_fn,
                       run.device, run.total_steps - done, cfg.topology.max_in_flight, heartbeat=run.watchdog.beat,
                       stop_requested=run.stop, on_step=on_step, timer=on_timer)
    run.log(f"target rank {topo.rank}: done, busy {stats['busy_s']:.1f}s, waiting on drafters {stats['wait_s']:.1f}s")
    return _finish_distributed(topo, {"role": "target", **stats})


def _taps_source(run: Run):
    """Where this drafter rank's taps come from; also fills the held-out batches' taps."""
    taps_width = run.dcfg.num_taps * run.dcfg.hidden_size
    dtype, index = run.target.dtype, run.topo.drafter_index
    if run.stored_taps is not None:
        setup.fill_eval_taps(run.eval_mbs, run.held_out_taps, dtype)
        return StoredTapsSource(run.train_samples, run.sampler, run.plan, index, run.collate_fn,
                                lambda i: run.stored_taps[i], dtype)
    if run.topo.mode == "colocated":
        for mb in run.eval_mbs:
            mb.taps = compute_taps(run.target, run.layer_ids, mb, run.device)
        return ColocatedSource(run.train_samples, run.sampler, run.plan, index, run.collate_fn, run.target,
                               run.layer_ids, run.device)
    _recv_eval_taps(run.eval_mbs, run.topo, taps_width, dtype, run.device)
    return RemoteSource(run.train_samples, run.sampler, run.plan, run.topo, run.collate_fn, taps_width, dtype,
                        run.device, steps_left=run.total_steps)


def _step_context(run: Run) -> StepContext:
    cuda = run.device.type == "cuda"
    lm_head = run.target.lm_head_weight.detach()
    vocab = setup.train_vocab_of(run.cfg, run.train_samples, run.target.vocab_size, run.log)
    vocab = vocab.to(run.device) if vocab is not None else None
    return StepContext(embed_weight=run.target.embed_weight.detach(),
                       lm_head_weight=lm_head, block_size=run.dcfg.block_size,
                       mask_token_id=run.dcfg.mask_token_id, layer_types=run.dcfg.layer_types,
                       sliding_window=run.dcfg.sliding_window, gamma=setup.gamma_of(run.cfg),
                       chunk_tokens=run.cfg.loss.chunk_tokens, backend=run.backend, device=run.device,
                       autocast_dtype=torch.bfloat16 if cuda else None, dp_group=run.dp_group,
                       num_drafters=run.topo.num_drafters, compile_loss=run.compiled, train_vocab=vocab,
                       train_lm_head=vocab.restrict(lm_head) if vocab is not None else None)


def _train_drafter(run: Run) -> dict:
    """A drafter rank: build, resume, then the loop; the main rank exports and evaluates."""
    cfg, topo, log = run.cfg, run.topo, run.log
    drafter = setup.init_drafter(run.dcfg, run.target, cfg.train.seed, cfg.drafter.init_from_target, run.device,
                                 cfg.drafter.init_norm_scale)
    ctx = _step_context(run)
    budget = TimeBudget(cfg.train.max_minutes)
    optimizer, scheduler = build_optimizer(drafter.parameters(), cfg.optim, run.total_steps, budget=budget)
    source = _taps_source(run)
    state = {"step": 0, "tokens": 0, "seconds": 0.0}
    if run.resume is not None:
        state = _restore(run.resume, drafter, optimizer, scheduler, source)
        log(f"resumed from {run.resume[0]} at step {state['step']}")
    model = parallelize(drafter, device=run.device, compile_model=run.compiled, dp_group=run.dp_group,
                        num_drafters=topo.num_drafters)
    if topo.is_main:
        log(setup.describe(cfg, run.dcfg, topo, len(run.train_samples), len(run.held_out), run.total_steps,
                           run.plan.accum, run.backend, run.compiled,
                           run.dcfg.num_taps * run.dcfg.hidden_size * run.target.dtype.itemsize))
    last_sim = _loop(run, drafter, model, ctx, optimizer, scheduler, source, state, budget)
    result = {"role": "drafter", "steps": state["step"], "total_steps": run.total_steps, "tokens": state["tokens"],
              "sim": last_sim, "interrupted": run.stop.signal, "out_dir": str(run.out_dir)}
    if topo.is_main:
        best = run.checkpointer.best() or run.checkpointer.latest()
        result["export"] = str(_export(best, run.out_dir, log))
        result["checkpoint"] = str(best)
        if cfg.eval.num_prompts > 0 and topo.mode == "colocated" and not run.stop():
            with run.watchdog.stage("real speculative decoding eval"):
                result.update(_real_eval(cfg, Path(result["export"]), run.target, run.out_dir, log))
    return _finish_distributed(topo, result)


def _loop(run: Run, drafter, model, ctx, optimizer, scheduler, source, state: dict, budget: TimeBudget):
    """The training loop: taps -> step -> log / held-out simulated tau / checkpoint. Returns the
    last held-out figures."""
    cfg, topo, watchdog = run.cfg, run.topo, run.watchdog
    metrics = MetricsLog(run.out_dir, run.total_steps, state["step"], topo.is_main, cfg.train.tensorboard)
    health = CompileHealthWatch(run.compiled, run.backend == "flex", state["step"], run.log)
    timer = ComputeTimer(run.device)
    meta = {"config": cfg.to_dict(), "provenance": provenance(topo.world_size)}
    last_sim = None
    interval_tokens, interval_start = 0, time.perf_counter()
    budget.start(state.get("seconds", 0.0))  # a resumed run continues its time budget
    run.stop.deferring = True
    while state["step"] < run.total_steps:
        watchdog.beat("waiting for taps")
        epoch, mbs = source.next_step()
        watchdog.beat("drafter step")
        timed = topo.mode == "disaggregated" and balance.in_window(state["step"] + 1)
        if timed:
            timer.start()
        stats, grad_norm = train_step(model, optimizer, scheduler, mbs, ctx, cfg.optim.grad_clip)
        if timed:
            timer.stop(sum(mb.input_ids.shape[0] for mb in mbs))
        state["step"] += 1
        step, last = state["step"], state["step"] == run.total_steps
        if _balance_due(run, step):
            taps = [mb.taps for mb in mbs]
            balance.share_and_report("drafter", timer.seconds_per_sequence(), topo, run.log,
                                     sum(t.numel() * t.element_size() for t in taps) / sum(t.shape[0] for t in taps))
        watchdog.timeout_s = cfg.train.watchdog_seconds  # warm-up (compilation) is over: strict from now
        inject_fault(topo.rank, step)
        health.after_step(step, last=last)
        step_tokens = sum(int(mb.attention_mask.sum()) for mb in mbs) * topo.num_drafters
        state["tokens"] += step_tokens
        interval_tokens += step_tokens
        out_of_time = budget.spent()
        stopping = _agree(run.stop() or out_of_time, ctx, step)
        if step % cfg.train.log_every == 0 or last or stopping:
            rate = interval_tokens / max(time.perf_counter() - interval_start, 1e-9)
            _log_step(metrics, _train_record(step, epoch, reduce_stats(stats, ctx, run.dcfg.block_size), grad_norm,
                                             scheduler, rate))
            interval_tokens, interval_start = 0, time.perf_counter()
        metrics.advance(1)
        if topo.is_main and (step % cfg.train.eval_every == 0 or last or stopping):
            with watchdog.stage("held-out simulated tau"):
                last_sim = simulated_tau(drafter, run.eval_mbs, ctx)
            metrics.log({"step": step, "seconds": round(budget.elapsed(), 1), "eval": last_sim})
            metrics.write(f"step {step}: held-out simulated tau {last_sim['sim_tau']:.3f}, acc {_fmt(last_sim['acc'])}")
        if topo.is_main and (step % cfg.train.ckpt_every == 0 or last or stopping):
            with watchdog.stage("checkpoint"), full_precision_weights(optimizer):
                state["seconds"] = budget.elapsed()
                path = run.checkpointer.save(step, drafter, _trainer_state(state, optimizer, scheduler, source),
                                             meta, sim_tau=last_sim["sim_tau"] if last_sim else None)
            metrics.write(f"step {step}: checkpoint {path}")
        if stopping:
            if run.stop.signal:
                metrics.write(f"stopping at step {step}: {run.stop.signal}; continue with --resume")
            else:  # the budget carries over on resume, so only a larger one trains further
                metrics.write(f"stopping at step {step}: train.max_minutes={cfg.train.max_minutes} spent; continue "
                              f"with --resume and a larger train.max_minutes (the time spent carries over)")
            break
    run.stop.deferring = False
    metrics.close()
    return last_sim


def _log_step(metrics: MetricsLog, record: dict) -> None:
    metrics.log(record)
    metrics.advance(0, {"loss": f"{record['loss']:.3f}", "acc1": f"{record['acc'][0]:.2f}",
                        "sim_tau": f"{record['sim_tau']:.2f}", "tok/s": f"{record['tokens_per_s']:.0f}"})


def _eval_prompt_sets(cfg: RunConfig) -> dict:
    if cfg.eval.prompts:
        from dflash_train.data.conversations import read_conversations

        conversations, _ = read_conversations(cfg.eval.prompts)
        return {"prompts": [c.messages for c in conversations[: cfg.eval.num_prompts]]}
    from dflash_train.data.corpus import default_eval_prompts

    return {name: prompts[: cfg.eval.num_prompts] for name, prompts in default_eval_prompts().items()}


def _real_eval(cfg: RunConfig, drafter_dir: Path, target, out_dir: Path, log) -> dict:
    """Real speculative decoding of the exported drafter against the target, on held-out prompts."""
    from dflash_train.eval.evaluate import evaluate
    from dflash_train.eval.report import lossless_note

    drafter = load_zlab(drafter_dir, device=target.device, dtype=target.dtype)
    target.eager_layers()  # decoding shapes change every step
    report = evaluate(drafter, target, _eval_prompt_sets(cfg), max_new_tokens=cfg.eval.max_new_tokens,
                      temperature=cfg.eval.temperature, thinking=cfg.data.thinking, seed=cfg.train.seed,
                      out_dir=out_dir / "eval")
    for name, figures in report["sets"].items():
        log(f"eval [{name}]: tau {figures['tau']:.3f}, speedup {figures['speedup']:.2f}x, "
            f"{figures['identical_outputs']}/{figures['num_prompts']} outputs identical to plain greedy")
        note = lossless_note(figures, target.dtype == torch.float32, cfg.eval.temperature)
        if note:
            log(f"eval [{name}]: {note}")
    return {"eval": report["sets"], "report": str(out_dir / "eval" / "report.json")}


def simulated_tau(drafter, eval_mbs, ctx: StepContext) -> dict:
    """Greedy acceptance on held-out data at fixed anchors, with the uncompiled drafter and the
    SDPA path, the eager loss and the full vocabulary (eval shapes differ from training shapes;
    no recompiles of the training graphs)."""
    eval_ctx = dataclasses.replace(ctx, backend="sdpa", num_drafters=1, compile_loss=False, train_vocab=None,
                                   train_lm_head=None)
    total = None
    drafter.eval()
    with torch.no_grad():
        for mb in eval_mbs:
            batch = to_device(mb, ctx.device)
            s = forward_stats(drafter, batch, eval_ctx)
            total = s if total is None else LossStats(**{k: getattr(total, k) + v for k, v in vars(s).items()})
    drafter.train()
    return summarize(total) if total is not None else {"sim_tau": float("nan"), "acc": []}


def _train_record(step, epoch, stats: LossStats, grad_norm, scheduler, tokens_per_s: float) -> dict:
    summary = summarize(stats)
    return {"step": step, "epoch": epoch, "loss": summary["loss"], "acc": summary["acc"], "sim_tau": summary["sim_tau"],
            "eal": summary["eal"], "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
            "tokens_per_s": tokens_per_s}


def _fmt(values) -> str:
    return "[" + " ".join(f"{v:.2f}" for v in values) + "]"


def _agree(flag: bool, ctx: StepContext, step: int) -> bool:
    """All drafter ranks stop at the same step. With several, they compare flags every
    AGREE_EVERY steps only: the all-reduce's `.item()` makes the host wait for the GPU."""
    if ctx.num_drafters == 1:
        return flag
    if step % AGREE_EVERY:
        return False
    t = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.dp_group)
    return bool(t.item())


def _trainer_state(state: dict, optimizer, scheduler, source) -> dict:
    return {"train": dict(state), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "data": source.state_dict(), "rng": rng_state()}


def _resume_point(cfg: RunConfig, topo, checkpointer: Checkpointer):
    """(path, trainer_state) of the latest checkpoint if resuming, read on the main drafter rank and
    shared with every rank (targets need the data cursor; no shared filesystem is assumed)."""
    payload = [None]
    if cfg.train.resume and (topo.is_main or not topo.distributed):
        path = checkpointer.latest()
        if path is None:
            print(f"resume: no checkpoint under {checkpointer.root}; starting fresh", flush=True)
        else:
            payload = [(str(path), torch.load(path / "trainer.pt", map_location="cpu", weights_only=True))]
    if topo.distributed:
        dist.broadcast_object_list(payload, src=topo.drafter_ranks[0])
    return payload[0]


def _restore(resume, drafter, optimizer, scheduler, source) -> dict:
    path, trainer = resume
    loaded, _, _ = Checkpointer.load(path, device=next(drafter.parameters()).device)
    with full_precision_weights(optimizer):  # bf16 weights: the float32 checkpoint loads into the masters
        drafter.load_state_dict(loaded.state_dict())
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    if isinstance(source, RemoteSource):
        source.load_state_dict(trainer["data"], steps_done=trainer["train"]["step"])
    else:
        source.load_state_dict(trainer["data"])
    set_rng_state(trainer["rng"])
    return dict(trainer["train"])


def _send_eval_taps(target, layer_ids, eval_mbs, topo, device) -> None:
    if topo.rank != topo.target_ranks[0]:
        return
    for mb in eval_mbs:
        dist.send(compute_taps(target, layer_ids, mb, device), dst=topo.drafter_ranks[0])


def _recv_eval_taps(eval_mbs, topo, width, dtype, device) -> None:
    if not topo.is_main:
        eval_mbs.clear()
        return
    for mb in eval_mbs:
        mb.taps = torch.empty(*mb.input_ids.shape, width, dtype=dtype, device=device)
        dist.recv(mb.taps, src=topo.target_ranks[0])


def _export(checkpoint: Path, out_dir: Path, log) -> Path:
    """The serving artefact: the chosen checkpoint's drafter in bf16, z-lab format."""
    drafter = load_zlab(checkpoint / "drafter", device="cpu")  # weights only: no optimizer state read
    path = save_zlab(drafter, out_dir / "drafter", dtype=torch.bfloat16)
    log(f"exported z-lab drafter {path} (from {checkpoint.name})")
    return path


def _finish_distributed(topo, result: dict) -> dict:
    if topo.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return result


def _logger(topo):
    prefix = "" if topo.is_main or not topo.distributed else f"[rank {topo.rank}] "

    def log(message: str) -> None:
        for line in str(message).splitlines():
            print(prefix + line, flush=True)

    return log
