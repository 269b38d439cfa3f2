"""`train(cfg)`: the one training loop. Read it top to bottom.

setup (topology, target, data, batching, resume point; beside it, a compiled run's compile prewarm process,
train/prewarm/) -> target ranks serve taps and return;
drafter ranks: build the drafter, optimizer and taps source, restore them, then while step < end:
taps -> step -> log / held-out simulated tau / checkpoint. Then the final checkpoint, the z-lab
export and, with the target in-process, real speculative decoding on held-out prompts. Every
process runs a watchdog. Every rank, target or drafter, votes after each step on stopping
(SIGTERM/SIGINT/SIGHUP anywhere, the launcher's death, a spent time budget) and all stop after the
same step, which the drafters checkpoint before any rank leaves (train/watch/stop.py).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_train.config import RunConfig
from dflash_train.data.anchors import anchor_coverage
from dflash_train.data.conversations import chat_record
from dflash_train.diagnostics.threads import contention_notice
from dflash_train.diagnostics.watchdog import Watchdog
from dflash_train.eval.evaluate import eval_draft_vocab, evaluate_as_served, set_notes
from dflash_train.eval.prompt_sets import SetContext, load_prompt_sets
from dflash_train.model.drafter.config import DrafterConfig
from dflash_train.model.drafter.export.hf_format import load_zlab
from dflash_train.model.target.load import load_target
from dflash_train.train.feed import balance
from dflash_train.train import setup
from dflash_train.train.feed.balance import ComputeTimer
from dflash_train.train.feed.batching import MicroBatch
from dflash_train.train.state import background
from dflash_train.train.state.checkpoint import (Checkpointer, DrafterState, ResumePoint, RNGState, TrainProgress,
                                                 export_checkpoint, provenance)
from dflash_train.train.watch.health import BadStepGuard, CompileHealthWatch, FaultPlan, NonFiniteSteps
from dflash_train.train.loss.objective import LossStats, summarize
from dflash_train.train.watch.metrics import MetricsLog, TokenInterval, fmt_values
from dflash_train.train.watch.profile import StepProfiler
from dflash_train.train.optim.optimizer import TimeBudget
from dflash_train.train.parallel.parallelize import use_shared_compile_cache
from dflash_train.train.prewarm.launch import FirstStep, Prewarm, start_prewarm
from dflash_train.train.state.provenance import Provenance, check_ranks_agree, fingerprints, layout_of
from dflash_train.train.feed.sources import Feed, TapsSource, TargetServer, build_source
from dflash_train.train.watch.simulate import simulated_tau, simulator
from dflash_train.train.step import StepContext, reduce_stats, train_step
from dflash_train.train.watch.stop import BUDGET_SPENT, PeerWatch, StopFlag, StopVote
from dflash_train.train.feed.taps import taps_spec
from dflash_train.train.parallel.topology import (Topology, control_group, init_distributed, init_target_groups,
                                                  pick_device, topology_from_env)
from dflash_train.validate import validate_run

SETUP_WATCHDOG_S = 1800.0  # loading, data preparation and the first (compiling) step beat rarely


@dataclasses.dataclass(frozen=True)
class Process:
    """This process: its config, place in the topology, device, logger and guards."""

    cfg: RunConfig
    topo: Topology
    device: torch.device
    dp_group: object  # the drafter ranks' process group (None for a world of one)
    ctl_group: object  # gloo over the whole world: stop votes and start-up sharing (None for a world of one)
    target_mesh: object  # this target rank's group mesh when groups shard the target, else None
    out_dir: Path
    log: object
    watchdog: Watchdog
    stop: StopFlag
    vote: StopVote
    watch: PeerWatch
    faults: FaultPlan
    prewarm: Prewarm | None  # this rank's compile prewarm, running beside setup (train/prewarm/launch.py)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every rank knows once setup is done (built by `_prepare`)."""

    target: object  # model.target.Target
    dcfg: DrafterConfig
    data: setup.Data
    feed: Feed
    total_steps: int
    kernels: setup.Kernels  # attention backend, compiled or not, the drafter's matmul precision
    checkpointer: Checkpointer
    resume: ResumePoint | None  # the verified checkpoint to continue, when resuming
    provenance: Provenance  # what this run trains with; checked against the resume point's


@dataclasses.dataclass(frozen=True)
class Training:
    """A drafter rank's training state: the Stateful parts (by checkpoint name) and what uses them."""

    drafter: torch.nn.Module
    model: torch.nn.Module  # what the step calls: cast, DDP-wrapped and compiled as configured
    ctx: StepContext
    source: TapsSource
    held_out: list[MicroBatch]
    progress: TrainProgress
    budget: TimeBudget
    weights: DrafterState
    states: dict  # name -> Stateful, as in trainer.pt


def train(cfg: RunConfig) -> dict:
    topo = topology_from_env(cfg.topology.mode, cfg.topology.target_ranks, cfg.topology.target_group_size,
                             cfg.topology.target_parallel)
    validate_run(cfg, topo)
    faults, stop, log = FaultPlan.from_env(), StopFlag(), _logger(topo)
    device = pick_device(topo)
    dp_group = init_distributed(topo, device)
    ctl_group = control_group(topo)
    target_mesh = init_target_groups(topo, device)
    out_dir = Path(cfg.train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    use_shared_compile_cache(out_dir.parent / ".compile-cache")
    prewarm = start_prewarm(cfg, topo, device, out_dir, faults, log)  # before the target and data: it overlaps them
    watchdog = Watchdog(max(cfg.train.watchdog_seconds, SETUP_WATCHDOG_S), name=f"rank{topo.rank}")
    watchdog.start()
    watch = PeerWatch(topo, stop, log).start(ctl_group)
    watchdog.explain = watch.stopped_note  # a stall caused by a stopped peer names it
    p = Process(cfg, topo, device, dp_group, ctl_group, target_mesh, out_dir, log, watchdog, stop,
                StopVote.for_topology(topo, ctl_group, cfg.topology.max_in_flight), watch, faults, prewarm)
    try:
        p, s = _prepare(p)
        return _serve(p, s) if topo.is_target else _train_drafter(p, s)
    except Exception as e:
        explained = watch.explain(e)  # a lost connection: name the rank that is gone
        if explained is e:
            raise
        raise explained from e
    finally:
        if prewarm is not None:
            prewarm.stop("the run ended before its first step")  # it would only hold the device and the cores
        watch.stop()
        watchdog.stop()


def _prepare(p: Process) -> tuple[Process, Setup]:
    """Target, drafter config, samples (and stored taps), batching, resume point; the process's config
    with `data.format` resolved from the target's tokenizer (`setup.resolve_format`)."""
    cfg, topo = p.cfg, p.topo
    notice = contention_notice(torch.get_num_threads())
    if notice:
        p.log(notice)
    resolved = []  # the config with data.format resolved, set once the tokenizer has loaded
    with p.watchdog.stage("load target"):
        target = load_target(cfg.target.model, cfg.target.gguf_file, cfg.target.dtype, p.device,
                             cfg.target.trust_remote_code,
                             check_tokenizer=lambda tok: resolved.append(setup.resolve_format(cfg, tok, p.log)),
                             tp_mesh=p.target_mesh, subset=setup.target_subset(cfg, topo, p.log),
                             pipeline=setup.pipeline_stage(topo))
        p = dataclasses.replace(p, cfg=resolved[0])
        cfg = p.cfg
        if cfg.target.precision == "fp8":
            target.quantize_fp8(log=p.log)  # before compile_layers and the regeneration pass
    dcfg = setup.build_drafter_config(cfg, target)
    spec = taps_spec(dcfg, target.dtype, final_hidden=cfg.loss.needs_target_hidden)
    with p.watchdog.stage("prepare data"):
        data = setup.load_data(cfg, topo, target, list(dcfg.target_layer_ids), spec, p.out_dir / "data", p.log,
                               p.watchdog.beat, p.ctl_group)
    kernels = setup.resolve_kernels(cfg, p.device, dcfg)
    if kernels.compiled and data.stored is None and topo.runs_target_forward:
        target.compile_layers()  # the target computes taps every step: fuse its elementwise work
    held_out = setup.eval_batches(data.held_out, cfg.eval.sim_anchors_per_seq, kernels.pad_multiple(cfg.data.max_len),
                                  cfg.data.max_len, per_batch=cfg.train.micro_batch)  # a batch the step's memory holds
    feed = Feed(data.train, setup.batch_plan(cfg, topo.num_drafters), setup.collate_args(cfg, kernels), held_out, spec,
                cfg.train.seed)
    total_steps = setup.total_steps_of(cfg, feed.sampler().steps_per_epoch)
    checkpointer = Checkpointer(p.out_dir, cfg.train.keep_last)
    resume = checkpointer.resume_point(cfg.train.resume, topo, p.ctl_group, p.log)
    prov = Provenance(fingerprints(cfg, target, dcfg, data.train, layout_of(cfg, topo), p.log),
                      cfg.train.allow_changed, p.log)
    check_ranks_agree(prov.current, topo, p.ctl_group)
    if resume is not None:  # before any state is loaded, on every rank: a mismatch stops them all
        prov.load_state_dict(resume.trainer.get("provenance", {}))
    return p, Setup(target, dcfg, data, feed, total_steps, kernels, checkpointer, resume, prov)


def _balance_due(p: Process, s: Setup, step: int) -> bool:
    return (p.topo.has_target_ranks and step == balance.BALANCE_STEP - 1
            and s.total_steps >= balance.BALANCE_STEP and s.resume is None)


def _serve(p: Process, s: Setup) -> dict:
    """A target rank: compute and send the taps of every micro-batch routed to it."""
    cfg, topo = p.cfg, p.topo
    server = TargetServer(s.feed, topo, s.target, list(s.dcfg.target_layer_ids), p.device,
                          cfg.topology.max_in_flight)
    if s.resume is not None:
        Checkpointer.restore(s.resume, {"data": server.sampler})  # the data cursor: where to go on
    step = server.sampler.steps_done
    health = CompileHealthWatch(s.kernels.compiled, False, step, p.log)
    server.send_held_out()
    p.stop.deferring = True
    while step < s.total_steps and not p.vote.stops_after(step):
        step += 1
        p.vote.before_step(step)
        server.serve_step(timed=balance.in_window(step), poison=p.faults.poisons(topo.rank, step))
        p.vote.after_step(step, p.stop.code)
        p.watchdog.beat("target: sent step")
        p.watchdog.timeout_s = cfg.train.watchdog_seconds  # warm-up (compilation) is over: strict from now
        p.faults.inject_fault(topo.rank, step)
        health.after_step(step, last=step == s.total_steps)
        if _balance_due(p, s, step):
            balance.share_and_report("target", server.balance.seconds_per_sequence(), topo, p.log)
    stats = server.finish()
    p.vote.finish()  # held until the drafters' checkpoint of the last step is written
    p.watch.stop()  # from here on the other ranks may leave
    p.log(f"target rank {topo.rank}: done, busy {stats['busy_s']:.1f}s, waiting on drafters {stats['wait_s']:.1f}s")
    stopped = p.vote.interruption(p.stop, topo, step)
    return _finish_distributed(p, {"role": "target", "steps": step, **stats, "interrupted": stopped})


def _step_context(p: Process, s: Setup, drafter: torch.nn.Module) -> StepContext:
    vocab = setup.train_vocab_of(p.cfg, s.data.train, s.target.vocab_size, p.log)
    return setup.step_context(p.cfg, s.target, s.dcfg, drafter, vocab, s.kernels, p.device, p.dp_group,
                              p.topo.num_drafters, p.log)


def _build_training(p: Process, s: Setup) -> Training:
    """Drafter, optimizer, schedule and taps source, restored from the resume point if any."""
    cfg = p.cfg
    budget = TimeBudget(cfg.train.max_minutes, s.total_steps)
    drafter, optimizer, scheduler = setup.drafter_and_optimizer(cfg, s.dcfg, s.target, p.device, s.total_steps, budget,
                                                                log=p.log if p.topo.is_main else None)
    source = build_source(s.feed, p.topo, s.target, list(s.dcfg.target_layer_ids), p.device, s.total_steps,
                          s.data.stored, stop_step=lambda: p.vote.stop_step)
    held_out = source.held_out()
    ctx = _step_context(p, s, drafter)
    draft_vocab = ctx.train_vocab.ids.cpu() if ctx.train_vocab is not None else None
    progress, weights = TrainProgress(), DrafterState(drafter, optimizer, draft_vocab)
    states = {"train": progress, "optimizer": optimizer, "scheduler": scheduler, "data": source, "budget": budget,
              "rng": RNGState(), "health": BadStepGuard(p.topo.rank, cfg.train.max_bad_steps, p.log),
              "provenance": s.provenance}
    if s.resume is not None:
        Checkpointer.restore(s.resume, states, weights)
        p.log(f"resumed from {s.resume.path} at step {progress.step}")
    model = setup.step_model(drafter, optimizer, cfg, s.kernels, p.device, p.dp_group, p.topo.num_drafters, p.log)
    return Training(drafter, model, ctx, source, held_out, progress, budget, weights, states)


def _train_drafter(p: Process, s: Setup) -> dict:
    """A drafter rank: build, resume, then the loop; the main rank exports and evaluates unless
    the job was asked to stop (a later --resume does both)."""
    cfg, topo, log = p.cfg, p.topo, p.log
    t = _build_training(p, s)
    if topo.is_main:
        coverage = anchor_coverage([sample.loss_mask for sample in s.data.train], cfg.train.num_anchors)
        log(setup.describe(cfg, s.dcfg, topo, len(s.data.train), len(s.data.held_out), s.total_steps,
                           s.feed.plan.accum, s.kernels, s.feed.spec.bytes_per_token, coverage))
    with background.settled_on_error(s.checkpointer.wait, log):  # a resume right after finds the checkpoint whole
        last_sim = _loop(p, s, t)
    p.vote.finish()  # the last checkpoint is written: every rank may leave
    p.watch.stop()  # (and the main one exports and evaluates alone)
    stopped = p.vote.interruption(p.stop, topo, t.progress.step)
    result = {"role": "drafter", "main": topo.is_main, "steps": t.progress.step, "total_steps": s.total_steps,
              "tokens": t.progress.tokens, "sim": last_sim, "interrupted": stopped, "out_dir": str(p.out_dir),
              "warnings": s.checkpointer.warnings}
    if topo.is_main and stopped:
        result["checkpoint"] = str(s.checkpointer.latest())
    elif topo.is_main:
        best = s.checkpointer.intact_best(log)
        record = chat_record(s.target.tokenizer, cfg.data.format, cfg.data.thinking)
        result["export"] = str(export_checkpoint(best, p.out_dir, log, cfg.target, record))
        result["checkpoint"] = str(best)
        if cfg.eval.num_prompts > 0 and topo.target_in_process:
            with p.watchdog.stage("real speculative decoding eval"):
                result.update(_real_eval(cfg, Path(result["export"]), s.target, p.out_dir, log, p.watchdog.beat,
                                         t.ctx))
    return _finish_distributed(p, result)


def _loop(p: Process, s: Setup, t: Training):
    """The training loop: taps -> step -> log / held-out simulated tau / checkpoint. Returns the
    last held-out figures."""
    cfg, topo, progress, budget = p.cfg, p.topo, t.progress, t.budget
    metrics = MetricsLog(p.out_dir, _end(s, budget), progress.step, topo.is_main, cfg.train.tensorboard)
    kernels, compiled = s.kernels, s.kernels.compiled
    health = CompileHealthWatch(compiled, kernels.backend == "flex", progress.step, metrics.above_bar(p.log),
                                kernels.graphs)
    timer, interval, last_sim = ComputeTimer(p.device), TokenInterval(), None
    undecided = budget.seconds is not None and budget.steps is None  # train.max_minutes still to measure the rate
    profiler = StepProfiler(cfg.train.profile_steps if topo.is_main else 0, p.device, p.out_dir,
                            metrics.above_bar(p.log), budget_undecided=undecided)
    meta = {"config": cfg.to_dict(), "provenance": provenance(topo.world_size), "fingerprints": s.provenance.current}
    budget.start(progress.step, progress.seconds)  # a resumed run continues its time budget
    first_step = FirstStep(compiled, p.prewarm, metrics.above_bar(p.log))
    first_step.wait_for_prewarm(p.watchdog.beat)  # inside the budget: the compile time it replaces counted there too
    p.stop.deferring = True
    while progress.step < _end(s, budget) and not p.vote.stops_after(progress.step):
        profiler.before_step(progress.step + 1)  # train.profile_steps: a window after warm-up (train/watch/profile.py)
        p.vote.before_step(progress.step + 1)
        epoch, mbs, stats, grad_norm = _one_step(p, s, t, timer, profiler)
        first_step.report()  # once: its time and how many of its graphs inductor's caches held
        step = progress.step
        _decide_budget(p, t, metrics, step)
        p.vote.after_step(step, p.stop.code or (BUDGET_SPENT if budget.spent() else 0))
        last, stopping = step == _end(s, budget), p.vote.stops_after(step)
        health.after_step(step, last=last)
        interval.add(progress, t.source.step_tokens)
        if step % cfg.train.log_every == 0 or step % cfg.train.ckpt_every == 0 or last or stopping:
            _check_finite(t.states["health"], s)  # same steps on every rank: all stop together, before a checkpoint
        if step % cfg.train.log_every == 0 or last or stopping:
            record = _train_record(step, epoch, reduce_stats(stats, t.ctx), grad_norm,
                                   t.states["scheduler"], interval.rate(p.device))
            _log_step(metrics, record | {"skipped_steps": t.states["health"].total, "tokens": progress.tokens})
        metrics.advance(1)
        last_sim = _held_out(p, t, metrics, step, last or stopping, last_sim)
        if step % cfg.train.ckpt_every == 0 and not (last or stopping):
            _revise_budget(p, t, metrics, step)  # before the checkpoint, which records it
        _checkpoint(p, s, t, metrics, meta, step, last or stopping, last_sim)
        if stopping or (last and budget.steps is not None and step < s.total_steps):
            metrics.write(p.vote.message(step, p.topo.role, cfg.train.max_minutes))
        profiler.after_step(step)
    profiler.close()
    metrics.close()
    return last_sim


def _one_step(p: Process, s: Setup, t: Training, timer: ComputeTimer, profiler: StepProfiler):
    """Receive (or read) the step's taps and train on them: (epoch, micro-batches, stats, grad norm)."""
    topo, progress = p.topo, t.progress
    p.watchdog.beat("waiting for taps")
    with profiler.phase("taps"):
        epoch, mbs = t.source.next_step()
    p.faults.corrupt_taps(topo.rank, progress.step + 1, mbs)
    p.watchdog.beat("drafter step")
    timed = topo.has_target_ranks and balance.in_window(progress.step + 1)
    if timed:
        timer.start()
    with profiler.phase("train_step"):
        stats, grad_norm, flags = train_step(t.model, t.states["optimizer"], t.states["scheduler"], mbs, t.ctx,
                                             p.cfg.optim.grad_clip, apply=not p.faults.skips(progress.step + 1),
                                             progress=progress.step / max(1, _end(s, t.budget)))
    if timed:
        timer.stop(sum(mb.input_ids.shape[0] for mb in mbs))
    progress.step += 1
    t.states["health"].record(progress.step, mbs, flags)
    if _balance_due(p, s, progress.step):
        balance.share_and_report("drafter", timer.seconds_per_sequence(), topo, p.log, balance.bytes_per_sequence(mbs))
    p.watchdog.timeout_s = p.cfg.train.watchdog_seconds  # warm-up (compilation) is over: strict from now
    p.faults.inject_fault(topo.rank, progress.step)
    return epoch, mbs, stats, grad_norm


def _decide_budget(p: Process, t: Training, metrics: MetricsLog, step: int) -> None:
    """train.max_minutes: once the rate is measured, every rank records the same step count."""
    decided = t.budget.propose(step)
    if decided is not None:
        t.budget.record(_agree_min(decided, t.ctx))
        metrics.set_total(t.budget.steps)  # the bar's total and ETA follow the decision, not the epoch count
        metrics.write(f"step {step}: train.max_minutes={p.cfg.train.max_minutes} allows {t.budget.steps} steps at "
                      f"the measured rate (recorded; the lr's cosine ends there){t.budget.epochs_cap()}")


def _revise_budget(p: Process, t: Training, metrics: MetricsLog, step: int) -> None:
    """train.max_minutes: every drafter rank re-decides the step count from the rate so far, the held-out
    evals and checkpoints included (`TimeBudget.revise`), and records the smallest."""
    revised = t.budget.revise(step)
    if revised is None:
        return
    before, after = t.budget.steps, _agree_min(revised, t.ctx)
    t.budget.record(after)
    if after != before:
        metrics.set_total(after)
    if abs(after - before) >= max(1, before // 100):  # said when it moves by 1 % or more (a checkpoint can be 20 steps)
        metrics.write(f"step {step}: train.max_minutes={p.cfg.train.max_minutes} allows {after} steps, not {before}, "
                      f"at the rate so far with its held-out evals and checkpoints (recorded; the cosine ends there)"
                      f"{t.budget.epochs_cap()}")


def _held_out(p: Process, t: Training, metrics: MetricsLog, step: int, final: bool, last_sim):
    """On the main rank, when due (or `final`): held-out simulated tau. Returns the latest figures."""
    if not p.topo.is_main or not _eval_due(p, step, final):
        return last_sim
    start = time.perf_counter()  # its cost is inside a time budget: said, so a run shows what its evals take
    with p.watchdog.stage("held-out simulated tau"):
        last_sim = simulated_tau(t.drafter, t.held_out, t.ctx)
    spent = time.perf_counter() - start
    metrics.log({"step": step, "seconds": round(t.budget.elapsed(), 1), "eval": last_sim,
                 "eval_seconds": round(spent, 3)})
    samples = sum(len(mb.ids) for mb in t.held_out)
    metrics.write(f"step {step}: held-out simulated tau {last_sim['sim_tau']:.3f} ({samples} samples in "
                  f"{spent:.2f} s), acc {fmt_values(last_sim['acc'])}")
    return last_sim


def _eval_due(p: Process, step: int, final: bool) -> bool:
    """Whether this step runs the held-out eval (every train.eval_every steps, and the last)."""
    return step % p.cfg.train.eval_every == 0 or final


def _checkpoint(p: Process, s: Setup, t: Training, metrics: MetricsLog, meta: dict, step: int, final: bool,
                last_sim) -> None:
    """On the main rank, when due (or `final`): a checkpoint, `best` only by a figure measured on these weights."""
    cfg, progress = p.cfg, t.progress
    if not p.topo.is_main or not (step % cfg.train.ckpt_every == 0 or final):
        return
    with p.watchdog.stage("checkpoint"), p.watch.holding():
        progress.seconds = t.budget.elapsed()
        sim_tau = last_sim["sim_tau"] if _eval_due(p, step, final) else None
        path = s.checkpointer.save(step, t.weights, t.states, meta, sim_tau=sim_tau, background_write=not final)
    metrics.write(f"step {step}: checkpoint {path}{'' if final else ' (written beside the training)'}")


def _check_finite(guard: BadStepGuard, s: Setup) -> None:
    """Read the non-finite guard's flags; too many bad steps in a row end the run, naming the
    checkpoint to resume from (skipped steps never touched its weights)."""
    try:
        guard.check()
    except NonFiniteSteps as e:
        raise NonFiniteSteps(f"{e} ({s.checkpointer.latest() or 'none written yet'})") from None


def _end(s: Setup, budget: TimeBudget) -> int:
    """The last step: a time budget's recorded decision, else the configured total."""
    return budget.steps if budget.steps is not None else s.total_steps


def _log_step(metrics: MetricsLog, record: dict) -> None:
    metrics.log(record)
    metrics.advance(0, {"loss": f"{record['loss']:.3f}", "acc1": f"{record['acc'][0]:.2f}",
                        "sim_tau": f"{record['sim_tau']:.2f}", "tok/s": f"{record['tokens_per_s']:.0f}"})


def _eval_prompt_sets(cfg: RunConfig, target, out_dir: Path, log) -> dict:
    context = SetContext(target=target, data=cfg.data, seed=cfg.train.seed, cache_dir=out_dir / "data")
    return load_prompt_sets(cfg.eval.prompts, cfg.eval.num_prompts, context, log)


def _real_eval(cfg: RunConfig, drafter_dir: Path, target, out_dir: Path, log, heartbeat, ctx: StepContext) -> dict:
    """Real speculative decoding of the exported drafter against the target, on held-out prompts,
    with the simulated tau of the same decoded text beside each set's real tau."""
    drafter = load_zlab(drafter_dir, device=target.device, dtype=target.dtype)
    if cfg.target.precision == "fp8":
        log("eval: the target decodes in FP8 (target.precision=fp8): at batch 1 that is ~5x slower than bf16 "
            "on an H200 (dynamic activation scaling at every linear; docs/LOG.md, session 7)")
    vocab = eval_draft_vocab(cfg.eval, drafter_dir, drafter, log)
    with torch.compiler.set_stance("force_eager"):  # decoding shapes change every step: no compiled layers
        report = evaluate_as_served(drafter, target, _eval_prompt_sets(cfg, target, out_dir, log), cfg.eval.draft_vocab,
                                    vocab, max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature,
                                    thinking=cfg.data.thinking, seed=cfg.train.seed, out_dir=out_dir / "eval",
                                    heartbeat=heartbeat, simulate=lambda v: simulator(drafter, target, ctx, v),
                                    text_prompt_tokens=cfg.data.text_prompt_tokens, near_tie_gap=cfg.eval.near_tie_gap,
                                    near_tie_gap_float32=cfg.eval.near_tie_gap_float32, decoder=cfg.eval.decoder,
                                    dtype=cfg.eval.dtype)
    log(f"eval: decoded by the {report['decoder']} loops in {report['dtype']} (eval.dtype={cfg.eval.dtype})")
    for name, figures in report["sets"].items():
        log(f"eval [{name}]: tau {figures['tau']:.3f} (simulated on the same text {figures['sim_tau']:.3f}: "
            f"{figures['sim_tau'] / figures['tau'] - 1:+.0%}; per anchor {figures['sim_tau_anchors']:.3f}), "
            f"speedup {figures['speedup']:.2f}x "
            f"(a draft+verify cycle costs {figures['cycle_plain_steps']:.2f} plain steps), "
            f"{figures['identical_outputs']}/{figures['num_prompts']} outputs identical to plain greedy")
        for note in set_notes(figures, report["dtype"], cfg.eval.temperature):
            log(f"eval [{name}]: {note}")
    return {"eval": report["sets"], "report": str(out_dir / "eval" / "report.json")}


def _train_record(step, epoch, stats: LossStats, grad_norm, scheduler, tokens_per_s: float) -> dict:
    summary = summarize(stats)
    return {"step": step, "epoch": epoch, "loss": summary["loss"], "acc": summary["acc"], "sim_tau": summary["sim_tau"],
            "eal": summary["eal"], "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
            "tokens_per_s": tokens_per_s}


def _agree_min(value: int, ctx: StepContext) -> int:
    """The smallest of the drafter ranks' values (one all-reduce; every rank calls it at the same step)."""
    if ctx.num_drafters == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.dp_group)
    return int(t.item())


def _finish_distributed(p: Process, result: dict) -> dict:
    """After `StopVote.finish`: every rank got here (no barrier needed)."""
    if p.topo.distributed and dist.is_initialized():
        dist.destroy_process_group()
    return result


def _logger(topo):
    prefix = "" if topo.is_main or not topo.distributed else f"[rank {topo.rank}] "

    def log(message: str) -> None:
        for line in str(message).splitlines():
            print(prefix + line, flush=True)

    return log
