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
from dflash_train.model.hf_format import save_zlab
from dflash_train.train import balance, setup
from dflash_train.train.balance import ComputeTimer
from dflash_train.train.batching import BatchPlan, StepSampler
from dflash_train.train.checkpoint import Checkpointer, provenance, rng_state, set_rng_state
from dflash_train.train.loss import LossStats, summarize
from dflash_train.train.metrics import MetricsLog
from dflash_train.train.optim import build_optimizer
from dflash_train.train.parallel import parallelize, resolve_backend, resolve_compile, use_shared_compile_cache
from dflash_train.train.sources import (CollateArgs, ColocatedSource, RemoteSource, StoredTapsSource, compute_taps,
                                        serve_taps)
from dflash_train.train.step import StepContext, forward_stats, reduce_stats, train_step
from dflash_train.train.topology import init_distributed, pick_device, topology_from_env

PAD_MULTIPLE = 64  # uncompiled runs pad lengths to this multiple; compiled runs pad to max_len (static)
HEALTH_WARMUP_STEPS, HEALTH_CHECK_STEPS = 2, 2  # compile during the first, verify over the next
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
    """Set by SIGTERM/SIGINT; the loop checkpoints and stops at the next step boundary."""

    def __init__(self):
        self.signal = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signal.Signals(signum).name

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


def _run(cfg, topo, device, dp_group, out_dir, log, watchdog, stop) -> dict:
    from dflash_train.model.target import load_target

    with watchdog.stage("load target"):
        target = load_target(cfg.target.model, cfg.target.gguf_file, cfg.target.dtype, device,
                             cfg.target.trust_remote_code)
    dcfg = setup.build_drafter_config(cfg, target)
    layer_ids = list(dcfg.target_layer_ids)
    stored_taps = held_out_taps = None
    with watchdog.stage("prepare data"):
        if topo.mode == "offline":
            (train_samples, stored_taps), (held_out, held_out_taps) = setup.samples_from_shards(cfg, layer_ids, log)
        elif setup.taps_from_regeneration(cfg, topo):
            (train_samples, stored_taps), (held_out, held_out_taps) = setup.prepare_tapped(
                cfg, target, layer_ids, out_dir / "data", log, watchdog.beat)
        else:
            train_samples, held_out = setup.load_or_build_samples(cfg, target, topo, out_dir / "data", log,
                                                                  heartbeat=watchdog.beat)
    plan = BatchPlan(cfg.train.seqs_per_step, cfg.train.micro_batch, topo.num_drafters)
    sampler = StepSampler(len(train_samples), cfg.train.seqs_per_step, cfg.train.seed)
    total_steps = setup.total_steps_of(cfg, sampler.steps_per_epoch)
    backend = resolve_backend(cfg.train.attention, device)
    compiled = resolve_compile(cfg.train.compile, device)
    pad_multiple = cfg.data.max_len if compiled else PAD_MULTIPLE
    collate_fn = CollateArgs(cfg.train.seed, cfg.train.num_anchors, pad_multiple, cfg.data.max_len)
    eval_mbs = setup.eval_batches(held_out, cfg.eval.sim_anchors_per_seq, pad_multiple, cfg.data.max_len)
    checkpointer = Checkpointer(out_dir, cfg.train.keep_last)
    resume = _resume_point(cfg, topo, checkpointer)

    balance_timer = ComputeTimer(device)

    def _target_timer(k: int, event: str, sequences: int) -> None:
        if balance.in_window(k):
            balance_timer.start() if event == "start" else balance_timer.stop(sequences)

    def _target_step(k: int) -> None:
        watchdog.timeout_s = cfg.train.watchdog_seconds
        inject_fault(topo.rank, k)
        if k == balance.BALANCE_STEP - 1 and total_steps >= balance.BALANCE_STEP and resume is None:
            balance.share_and_report("target", balance_timer.seconds_per_sequence(), topo, log)

    if topo.is_target:
        if resume is not None:
            sampler.load_state_dict(resume[1]["data"])
        _send_eval_taps(target, layer_ids, eval_mbs, topo, device)
        stats = serve_taps(target, layer_ids, train_samples, sampler, plan, topo, collate_fn, device,
                           total_steps - (resume[1]["train"]["step"] if resume else 0), cfg.topology.max_in_flight,
                           heartbeat=watchdog.beat, stop_requested=stop, on_step=_target_step, timer=_target_timer)
        log(f"target rank {topo.rank}: done, busy {stats['busy_s']:.1f}s, waiting on drafters {stats['wait_s']:.1f}s")
        return _finish_distributed(topo, {"role": "target", **stats})

    # ---- drafter rank ------------------------------------------------------------------------
    balance_timer = ComputeTimer(device)
    drafter = setup.init_drafter(dcfg, target, cfg.train.seed, cfg.drafter.init_from_target, device)
    ctx = StepContext(embed_weight=target.embed_weight.detach(), lm_head_weight=target.lm_head_weight.detach(),
                      block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id, layer_types=dcfg.layer_types,
                      sliding_window=dcfg.sliding_window, gamma=setup.gamma_of(cfg), chunk_tokens=cfg.loss.chunk_tokens,
                      backend=backend, device=device,
                      autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
                      dp_group=dp_group, num_drafters=topo.num_drafters)
    optimizer, scheduler = build_optimizer(drafter.parameters(), cfg.optim, total_steps, fused=device.type == "cuda")
    taps_width = dcfg.num_taps * dcfg.hidden_size
    if stored_taps is not None:
        source = StoredTapsSource(train_samples, sampler, plan, topo.drafter_index, collate_fn,
                                  lambda i: stored_taps[i], target.dtype)
        setup.fill_eval_taps(eval_mbs, held_out_taps, target.dtype)
    elif topo.mode == "colocated":
        source = ColocatedSource(train_samples, sampler, plan, topo.drafter_index, collate_fn, target, layer_ids, device)
        for mb in eval_mbs:
            mb.taps = compute_taps(target, layer_ids, mb, device)
    else:
        source = RemoteSource(train_samples, sampler, plan, topo, collate_fn, taps_width, target.dtype, device,
                              steps_left=total_steps)
        _recv_eval_taps(eval_mbs, topo, taps_width, target.dtype, device)
    state = {"step": 0, "tokens": 0, "seconds": 0.0}
    if resume is not None:
        state = _restore(resume, drafter, optimizer, scheduler, source)
        log(f"resumed from {resume[0]} at step {state['step']}")
    model = parallelize(drafter, device=device, compile_model=compiled, dp_group=dp_group,
                        num_drafters=topo.num_drafters)
    if topo.is_main:
        log(setup.describe(cfg, dcfg, topo, len(train_samples), len(held_out), total_steps, plan.accum, backend,
                           compiled, taps_width * target.dtype.itemsize))
    metrics = MetricsLog(out_dir, total_steps, state["step"], topo.is_main, cfg.train.tensorboard)
    health = CompileHealthWatch(compiled, backend == "flex", state["step"], log)
    meta = {"config": cfg.to_dict(), "provenance": provenance(topo.world_size)}
    last_sim = None
    interval_tokens, interval_start, budget_start = 0, time.perf_counter(), time.perf_counter()

    while state["step"] < total_steps:
        watchdog.beat("waiting for taps")
        epoch, mbs = source.next_step()
        watchdog.beat("drafter step")
        timed = topo.mode == "disaggregated" and balance.in_window(state["step"] + 1)
        if timed:
            balance_timer.start()
        stats, grad_norm = train_step(model, optimizer, scheduler, mbs, ctx, cfg.optim.grad_clip)
        if timed:
            balance_timer.stop(sum(mb.input_ids.shape[0] for mb in mbs))
        state["step"] += 1
        if topo.mode == "disaggregated" and state["step"] == balance.BALANCE_STEP - 1 \
                and total_steps >= balance.BALANCE_STEP and resume is None:
            balance.share_and_report("drafter", balance_timer.seconds_per_sequence(), topo, log)
        watchdog.timeout_s = cfg.train.watchdog_seconds  # warm-up (compilation) is over: strict from now
        inject_fault(topo.rank, state["step"])
        health.after_step(state["step"], last=state["step"] == total_steps)
        step_tokens = sum(int(mb.attention_mask.sum()) for mb in mbs) * topo.num_drafters
        state["tokens"] += step_tokens
        interval_tokens += step_tokens
        step, last = state["step"], state["step"] == total_steps
        out_of_time = bool(cfg.train.max_minutes) and time.perf_counter() - budget_start > 60 * cfg.train.max_minutes
        stopping = _agree(stop() or out_of_time, ctx)
        if step % cfg.train.log_every == 0 or last or stopping:
            rate = interval_tokens / max(time.perf_counter() - interval_start, 1e-9)
            record = _train_record(step, epoch, reduce_stats(stats, ctx, dcfg.block_size), grad_norm, scheduler, rate)
            metrics.log(record)
            metrics.advance(0, {"loss": f"{record['loss']:.3f}", "acc1": f"{record['acc'][0]:.2f}",
                                "sim_tau": f"{record['sim_tau']:.2f}", "tok/s": f"{rate:.0f}"})
            interval_tokens, interval_start = 0, time.perf_counter()
        metrics.advance(1, {})
        if topo.is_main and (step % cfg.train.eval_every == 0 or last or stopping):
            with watchdog.stage("held-out simulated tau"):
                last_sim = simulated_tau(drafter, eval_mbs, ctx)
            metrics.log({"step": step, "eval": last_sim})
            metrics.write(f"step {step}: held-out simulated tau {last_sim['sim_tau']:.3f}, acc {_fmt(last_sim['acc'])}")
        if topo.is_main and (step % cfg.train.ckpt_every == 0 or last or stopping):
            with watchdog.stage("checkpoint"):
                state["seconds"] = time.perf_counter() - budget_start
                path = checkpointer.save(step, drafter, _trainer_state(state, optimizer, scheduler, source),
                                         meta, sim_tau=last_sim["sim_tau"] if last_sim else None)
            metrics.write(f"step {step}: checkpoint {path}")
        if stopping:
            why = stop.signal or f"train.max_minutes={cfg.train.max_minutes} spent"
            metrics.write(f"stopping at step {step}: {why}; resume with train.resume=true")
            break
    metrics.close()
    result = {"role": "drafter", "steps": state["step"], "total_steps": total_steps, "tokens": state["tokens"],
              "sim": last_sim, "interrupted": stop.signal, "out_dir": str(out_dir)}
    if topo.is_main:
        best = checkpointer.best() or checkpointer.latest()
        result["export"] = str(_export(best, out_dir, log))
        result["checkpoint"] = str(best)
        if cfg.eval.num_prompts > 0 and topo.mode == "colocated" and not stop():
            with watchdog.stage("real speculative decoding eval"):
                result.update(_real_eval(cfg, Path(result["export"]), target, out_dir, log))
    return _finish_distributed(topo, result)


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
    from dflash_train.model.hf_format import load_zlab

    drafter = load_zlab(drafter_dir, device=target.device, dtype=target.dtype)
    report = evaluate(drafter, target, _eval_prompt_sets(cfg), max_new_tokens=cfg.eval.max_new_tokens,
                      temperature=cfg.eval.temperature, thinking=cfg.data.thinking, seed=cfg.train.seed,
                      out_dir=out_dir / "eval")
    for name, figures in report["sets"].items():
        log(f"eval [{name}]: tau {figures['tau']:.3f}, speedup {figures['speedup']:.2f}x")
    return {"eval": report["sets"], "report": str(out_dir / "eval" / "report.json")}


class CompileHealthWatch:
    """After warm-up, verify that no step compiles anything new and that flex attention runs
    compiled (no eager fallback); then forbid recompiles for the rest of the run. Fails loudly."""

    def __init__(self, enabled: bool, expect_flex: bool, start_step: int, log):
        self.enabled, self.expect_flex, self.log = enabled, expect_flex, log
        self.before = None
        self.warm_at = start_step + HEALTH_WARMUP_STEPS
        self.check_at = self.warm_at + HEALTH_CHECK_STEPS
        if enabled:
            from dflash_train.diagnostics.compile_health import track_eager_flex_calls

            track_eager_flex_calls()

    def after_step(self, step: int, last: bool) -> None:
        if not self.enabled:
            return
        from dflash_train.diagnostics import compile_health as ch

        if step == self.warm_at:
            self.before = ch.CompileCounters.snapshot()
        elif self.before is not None and (step == self.check_at or last):
            report = ch.assert_compile_healthy(self.before, ch.CompileCounters.snapshot(),
                                               expect_compiled_flex=self.expect_flex)
            frozen = ch.freeze_compilation()
            self.log(f"compile health: OK after warm-up ({report.summary()}); recompiles "
                     f"{'now forbidden' if frozen else 'not forbidden (no set_stance in this torch)'}")
            self.before = None


def simulated_tau(drafter, eval_mbs, ctx: StepContext) -> dict:
    """Greedy acceptance on held-out data at fixed anchors, with the uncompiled drafter and the
    SDPA path (eval shapes differ from training shapes; no recompiles of the training graph)."""
    eval_ctx = dataclasses.replace(ctx, backend="sdpa", num_drafters=1)
    total = None
    drafter.eval()
    with torch.no_grad():
        for mb in eval_mbs:
            batch = {k: getattr(mb, k).to(ctx.device) for k in ("input_ids", "loss_mask", "anchors", "keep", "taps")}
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


def _agree(flag: bool, ctx: StepContext) -> bool:
    """All drafter ranks stop at the same step (one tiny all-reduce when there are several)."""
    if ctx.num_drafters == 1:
        return flag
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
    drafter, _, _ = Checkpointer.load(checkpoint, device="cpu")
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
