"""The disaggregated pipeline on two processes: rank 0 runs the target and sends taps
(`sources.TargetServer`), rank 1 receives them (`sources.RemoteSource`) and trains the drafter
(`step.train_step`). Random Qwen3-8B-shaped target and drafter, synthetic samples.

    torchrun --standalone --nproc-per-node 2 bench/pipeline.py               # 2 H200s, NCCL
    torchrun --standalone --nproc-per-node 2 bench/pipeline.py --block-size 32 --anchors 64
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/pipeline.py --small   # gloo, CPU
    torchrun --standalone --nproc-per-node 2 bench/pipeline.py --precision fp8   # float8 target and drafter

`--precision fp8` runs both sides' linear layers in float8 (torchao; sm89+ GPUs): the target's as
target.precision=fp8 (rowwise scales), the drafter's as train.precision=fp8 (`--fp8-recipe`).

Figures (printed by rank 1): end-to-end tokens/s over the timed steps; each side's busy fraction
(its compute time per step / the pipeline's wall time per step; compute timed with CUDA events on
GPU, so transfer and back-pressure waits are not counted as busy); each side's standalone
capacity; the drafter's time blocked waiting for taps.

The target serves warm-up + timed + `prefetch` steps, so that every receive RemoteSource posts
ahead is matched by a send; the drafter waits on those last receives before shutting down.
A failure on either rank exits the process at once (torchrun then stops the other one).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import _common as C  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description="disaggregated target -> drafter pipeline benchmark (2 ranks)")
    C.add_shape_args(p, device=False)
    p.add_argument("--layers", type=int, help="drafter layers (default 5; 2 with --small)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (one target forward)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per drafter step")
    p.add_argument("--max-in-flight", type=int, default=2, help="target's unacknowledged sends")
    p.add_argument("--prefetch", type=int, default=1, help="drafter's receives posted ahead (steps)")
    p.add_argument("--attention", choices=("auto", "flex", "sdpa", "dense"), default="auto")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--chunk-tokens", type=int, default=2048)
    C.add_precision_args(p)
    p.add_argument("--steps", type=int, help="timed steps (default 20; 4 with --small)")
    p.add_argument("--warmup", type=int, help="warm-up steps, compile included (default 3; 1 with --small)")
    p.add_argument("--json", help="write the figures to this JSON file (rank 1)")
    a = p.parse_args(argv)
    C.fill_shape_defaults(a)
    a.layers = a.layers or (2 if a.small else 5)
    a.steps = a.steps or (4 if a.small else 20)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.small else 3)
    return a


class TimedTarget:
    """Wraps a Target: each `taps` call is timed (CUDA events on GPU, wall clock on CPU)."""

    def __init__(self, target, device):
        self.target, self.device, self.records = target, device, []

    def taps(self, *args, **kwargs):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.target.taps(*args, **kwargs)
            end.record()
            self.records.append((start, end))
        else:
            t0 = time.perf_counter()
            out = self.target.taps(*args, **kwargs)
            self.records.append(time.perf_counter() - t0)
        return out

    def seconds(self) -> list[float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [s.elapsed_time(e) / 1e3 for s, e in self.records]
        return list(self.records)


def fail_fast(b: C.Bench, title: str) -> None:
    """A failed phase on one rank would leave the other blocked in a send or receive: exit now."""
    if title in b.failed:
        b.log(f"exiting after the failed phase '{title}' (the other rank is stopped by torchrun)")
        print(f"VERDICT pipeline: FAILED in '{title}' on this rank", flush=True)
        sys.stdout.flush()
        os._exit(1)


def main(argv=None) -> int:
    a = parse(argv)
    C.cpu_threads(a.small)
    from dflash_train.train.feed.batching import BatchPlan, Sample
    from dflash_train.train.feed.sources import CollateArgs, Feed, RemoteSource, TargetServer
    from dflash_train.train.feed.taps import taps_spec
    from dflash_train.train.parallel.topology import Topology

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    b = C.Bench("pipeline", a, rank=rank)
    if world != 2:
        b.log(f"needs exactly 2 processes (got WORLD_SIZE={world}): torchrun --standalone --nproc-per-node 2 ...")
        print("VERDICT pipeline: FAILED: not launched with 2 processes", flush=True)
        return 2
    topo = Topology(mode="disaggregated", world_size=2, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                    num_target_ranks=1)
    use_cuda = torch.cuda.is_available() and not a.small
    if use_cuda and torch.cuda.device_count() < 2:
        b.log(f"only {torch.cuda.device_count()} GPU visible: NCCL point-to-point needs one GPU per rank")
        print("VERDICT pipeline: FAILED: needs 2 GPUs (or --small for CPU/gloo)", flush=True)
        return 2
    if use_cuda:
        torch.cuda.set_device(topo.local_rank)
        device = torch.device("cuda", topo.local_rank)
    else:
        device = torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    S, N, B = a.seq_len, a.anchors, a.block_size
    plan = BatchPlan(seqs_per_step=a.micro_batch * a.accum, micro_batch=a.micro_batch, num_drafters=1)

    with b.phase("init process group"):
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=900), **kwargs)
        dp_group = dist.new_group([1])  # the drafter ranks' group, as topology.init_distributed makes it
        b.log(f"{backend} process group up: {topo.describe()}; device {device}")
    fail_fast(b, "init process group")

    # Both ranks hold the same samples and sampler, so they agree on every micro-batch (sources.py).
    tcfg = C.target_config(a.small)
    num_samples = max(8, plan.seqs_per_step * 2)
    ids = C.synthetic_ids(num_samples, S, tcfg.vocab_size, seed=0)
    samples = [Sample(f"s{i}", tuple(ids[i].tolist()), (1,) * S) for i in range(num_samples)]
    collate_fn = CollateArgs(seed=0, num_anchors=N, pad_multiple=64, max_len=S)
    feed = Feed(samples, plan, collate_fn, [], taps_spec(C.drafter_config(tcfg, layers=a.layers, block_size=B,
                                                                          small=a.small), dtype), seed=0)
    total_target_steps = a.warmup + a.steps + a.prefetch

    if topo.is_target:
        with b.phase("build target"):
            from dflash_train.model.target.taps import build_target_layer_ids
            from dflash_train.model.target.target import Target

            layer_ids = build_target_layer_ids(tcfg.num_hidden_layers, 5)
            from dflash_train.train.parallel.parallelize import resolve_compile

            inner = Target(model=C.random_target(tcfg, device, dtype), tokenizer=None)
            if a.precision == "fp8":
                inner.quantize_fp8(log=b.log)  # as target.precision=fp8, before compiling
            compile_target = a.compile if a.compile is not None else resolve_compile("auto", device)
            if compile_target:
                inner.compile_layers()  # as the trainer's target ranks do
            target = TimedTarget(inner, device)
            b.log(f"target {tcfg.num_hidden_layers} layers, taps {layer_ids}, {dtype}, compiled layers {compile_target}")
        fail_fast(b, "build target")
        with b.phase("serve taps"):
            t0 = time.perf_counter()
            server = TargetServer(feed, topo, target, layer_ids, device, a.max_in_flight)
            for _ in range(total_target_steps):
                server.serve_step()
            stats = server.finish()
            stats["wall_s"] = time.perf_counter() - t0
            stats["calls_s"] = target.seconds()
            b.log(f"served {total_target_steps} steps in {stats['wall_s']:.1f}s: busy {stats['busy_s']:.1f}s "
                  f"(TargetServer's own count), waiting {stats['wait_s']:.1f}s, {stats['sent_bytes'] / 1e9:.2f} GB sent")
        fail_fast(b, "serve taps")
        dist.broadcast_object_list([stats], src=0)
        dist.barrier()
        dist.destroy_process_group()
        print(f"VERDICT pipeline rank0: OK: served {total_target_steps} steps", flush=True)
        return 0

    # ---- drafter rank ----------------------------------------------------------------------
    from dflash_train.train.parallel.parallelize import resolve_backend, resolve_compile

    try:
        attn = resolve_backend(a.attention, device)
    except ValueError as e:
        b.failed.append("options")
        b.log(f"bad option: {e}")
        fail_fast(b, "options")
    compiled = a.compile if a.compile is not None else resolve_compile("auto", device)
    b.info.update(device=str(device), backend=attn, compiled=compiled, seq_len=S, anchors=N, block_size=B,
                  layers=a.layers, micro_batch=a.micro_batch, accum=a.accum, max_in_flight=a.max_in_flight,
                  prefetch=a.prefetch, precision=a.precision)
    st: dict = {}
    with b.phase("build drafter"):
        from dflash_train.config import OptimConfig
        from dflash_train.train.optim.optimizer import build_optimizer, param_dtype
        from dflash_train.train.parallel.parallelize import parallelize

        dcfg = C.drafter_config(tcfg, layers=a.layers, block_size=B, small=a.small)
        drafter = C.random_drafter(dcfg, device)
        embed, lm_head = C.frozen_embeddings(tcfg.vocab_size, tcfg.hidden_size, device, dtype)
        ctx = C.step_context(dcfg, embed, lm_head, device, attn, a.chunk_tokens, dp_group=dp_group, num_drafters=1,
                             compile_loss=compiled)
        optimizer, scheduler = build_optimizer(drafter.parameters(), OptimConfig(), 1000)  # the trainer's choice
        model = parallelize(drafter, device=device, compile_model=compiled, dp_group=dp_group, num_drafters=1,
                            param_dtype=param_dtype(optimizer), precision=a.precision,
                            fp8_recipe=a.fp8_recipe or "tensorwise", log=b.log)
        source = RemoteSource(feed, topo, device, total_steps=a.warmup + a.steps + a.prefetch, prefetch=a.prefetch)
        b.log(f"drafter {dcfg.num_layers} layers, attention {attn}, compile {compiled}; S={S} N={N} B={B}, "
              f"{plan.seqs_per_step} seq/step ({a.accum} x {a.micro_batch})")
    fail_fast(b, "build drafter")

    from dflash_train.train.step import train_step

    def one_step(timed: list | None):
        t0 = time.perf_counter()
        epoch, mbs = source.next_step()
        waited = time.perf_counter() - t0
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()  # after the stream waits for the receives: compute only
            stats, _, _ = train_step(model, optimizer, scheduler, mbs, ctx, 1.0)
            end.record()
            if timed is not None:
                timed.append((start, end))
        else:
            t1 = time.perf_counter()
            stats, _, _ = train_step(model, optimizer, scheduler, mbs, ctx, 1.0)
            if timed is not None:
                timed.append(time.perf_counter() - t1)
        st["mean_ctx"] = sum(C.mean_context(mb) for mb in mbs) / len(mbs)
        return stats, waited

    health = C.compile_health_module() if compiled else None
    if health is not None:
        C.call_quietly(getattr(health, "track_eager_flex_calls", None))
    with b.phase("warm-up (compile)"):
        for i in range(a.warmup):
            t0 = time.perf_counter()
            stats, waited = one_step(None)
            C.sync(device)
            loss = float(stats.loss_sum / stats.weight_sum.clamp(min=1e-9))
            b.log(f"warm-up step {i + 1}/{a.warmup}: {time.perf_counter() - t0:.2f}s (waited {waited:.2f}s for taps), "
                  f"loss {loss:.3f}")
        st["counters_before"], st["health_before"] = C.compile_counters(), C.health_snapshot(health)
    fail_fast(b, "warm-up (compile)")

    with b.phase("timing"):
        timed, wait_total = [], 0.0
        C.sync(device)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            _, waited = one_step(timed)
            wait_total += waited
        C.sync(device)
        wall = time.perf_counter() - t0
        compute = [s.elapsed_time(e) / 1e3 for s, e in timed] if device.type == "cuda" else timed
        st.update(wall=wall, compute=compute, wait=wait_total)
        st["counters_after"], st["health_after"] = C.compile_counters(), C.health_snapshot(health)
    fail_fast(b, "timing")
    if compiled:
        with b.phase("compile health"):  # not fatal: the figures stand, the verdict says PARTIAL
            C.check_compile_health(b, health, st, expect_compiled_flex=attn == "flex")

    with b.phase("drain"):  # the receives posted ahead are matched by the target's extra steps
        for _, _, works, *_ in list(source.pending):
            for work in works:
                work.wait()
        source.pending.clear()
        C.sync(device)
        payload = [None]
        dist.broadcast_object_list(payload, src=0)
        target_stats = payload[0]
        dist.barrier()
        dist.destroy_process_group()
    fail_fast(b, "drain")

    tokens_per_step = plan.seqs_per_step * S
    wall, compute = st["wall"], st["compute"]
    per_step = wall / a.steps
    drafter_step = C.median(compute)
    calls = target_stats["calls_s"][(a.warmup) * a.accum:(a.warmup + a.steps) * a.accum] or target_stats["calls_s"]
    target_step = C.median(calls) * a.accum  # one target rank computes every micro-batch of a step
    b.figure("tokens_per_s", tokens_per_step / per_step, "end to end, timed steps")
    b.figure("step_wall_s", per_step)
    b.figure("drafter_step_compute_s", drafter_step)
    b.figure("target_step_compute_s", target_step)
    b.figure("drafter_busy_fraction", sum(compute) / wall)
    b.figure("target_busy_fraction", min(1.0, target_step / per_step), "target compute per step / step wall")
    b.figure("drafter_wait_fraction", st["wait"] / wall,
             "host time blocked on taps (NCCL waits are stream-side, so ~0 on GPU)")
    b.figure("drafter_capacity_tok_s", tokens_per_step / drafter_step)
    b.figure("target_capacity_tok_s", tokens_per_step / target_step)
    b.figure("taps_mb_per_step", target_stats["sent_bytes"] / total_target_steps / 1e6)
    b.info["serve_taps"] = {k: v for k, v in target_stats.items() if k != "calls_s"}
    f = b.figures
    bound = "drafter" if f["drafter_capacity_tok_s"] < f["target_capacity_tok_s"] else "target"
    verdict = (f"{C.fmt_rate(f['tokens_per_s'])} end to end; drafter busy {f['drafter_busy_fraction']:.0%}, "
               f"target busy {f['target_busy_fraction']:.0%}; capacities drafter {C.fmt_rate(f['drafter_capacity_tok_s'])}"
               f", target {C.fmt_rate(f['target_capacity_tok_s'])} ({bound}-bound)")
    return b.finish(verdict, a.json)


if __name__ == "__main__":
    sys.exit(main())
