"""Census of the ops the eval's fixed-shape decoder (eval/static_decode.py) runs per plain step and per
draft+verify cycle, by stage, on the CPU: a proxy of a cycle's cost on a GPU, where at these tiny shapes a
step is bound by its number of kernels and host round trips, not its FLOPs (issue 37).

    python3 bench/decode_census.py [--arch dspark|dflash] [--max-new-tokens 16] [--dtype bfloat16]
        [--ops 6] [--small] [--json OUT]

Target: the real SmolLM2-135M-Instruct (`load_target("smollm2")`, 30 layers). Drafter: the `gpu` recipe's
shape (6 sliding-window layers x 576, block 4, 5 taps; `--arch` picks the head), untrained (the ops do not
depend on the weights: every cycle runs the same fixed shapes). Both in `--dtype` (the GPU eval's bfloat16).

Method: `StaticDecoder.plain` and `.speculative` decode one prompt under torch.profiler (after an
unprofiled warm-up of both); the decoder's methods, the drafter's `run_layers` and `propose`, the draft
head's two halves (`scores`, the lm_head's matmul; `logits`, bias and scaling), the head's own modules,
the target's forward and the module functions static_decode calls are wrapped, for the profiled runs
only, in `record_function` ranges naming a stage. Every aten op is given to its innermost stage, and the
aten ops called from Python (none above them) are counted two ways: `calls`, all of them (the host's
dispatches in eager mode), and `kernels`, those that launch work (no view, no-op cast or allocation, or
something below them does): about what a CUDA graph replays. Per-cycle and per-step figures
are the run's totals over its cycles and steps (the shapes are fixed, so every cycle runs the same ops;
the bench checks it). Host reads (what would sync a GPU with the host) are the Python-level calls
`.tolist()`, `.item()`, `int()`/`float()`/`bool()`/index of a tensor, `.cpu()`, `.numpy()`, counted by a
torch-function mode, plus the `aten::nonzero` the profiler sees (boolean indexing, `nonzero`).

On a GPU, `CapturedStep` (data/graph_decode.py) records `_cycle` and `_plain_step` once per length bucket
and replays them as one CUDA graph each: the stages under "cycle" and "plain" are inside the graph,
the loop (the replay call, the host read of [acc, tokens], the stopping rule) and the prefill outside.
The CPU runs the same steps eagerly; the CPU-only few-row matmul route is switched off here, so the
ops are the GPU's (except attention and matmul internals, which are one op each on both).

`--device cuda` (not run yet: written on a machine without a GPU) profiles the same eager steps with
CUDA activity too, adding per stage the kernels launched and their summed durations (`launch`, `dev us`),
then decodes through the CUDA graphs and times every replay of the cycle and plain graphs (and every
prefill) with CUDA events: `graph_cycle_over_plain` is a cycle's cost in plain steps without the host
loop, and `graphs_captured` says whether both steps were captured (a failed capture decodes eagerly).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root on the path
from bench._common import Bench  # noqa: E402

from dflash_train import recipes
from dflash_train.eval import few_rows, static_decode
from dflash_train.eval.spec_decode import DraftHead
from dflash_train.eval.static_decode import StaticDecoder
from dflash_train.model.drafter.heads.architectures import HEADS, build_drafter
from dflash_train.model.target.load import load_target
from dflash_train.train.setup import build_drafter_config

PROMPT = [{"role": "user", "content": "Can you explain how a hash map works and when I should use one "
                                      "instead of a sorted list? Please give a short example in Python."}]
PREFIX = "census:"
NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "unsqueeze", "squeeze", "slice", "select", "transpose", "t",
    "numpy_T", "expand", "expand_as", "as_strided", "permute", "detach", "alias", "empty", "empty_strided", "split",
    "split_with_sizes", "chunk", "unbind", "lift_fresh", "to", "contiguous", "resolve_conj", "resolve_neg", "narrow",
    "view_as", "unflatten", "flatten", "movedim", "result_type", "is_nonzero", "empty_like", "set_", "resize_"))
FIGURES = ("calls", "kernels", "reads", "launches", "device_us")
HOST_READS = frozenset(("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"))
# where each stage runs on a GPU: inside the step's CUDA graph or on the host around it
CYCLE_STAGES = ("draft: block inputs", "draft: masks", "draft: backbone", "draft: chain: lm_head",
                "draft: chain: logits", "draft: chain: head modules", "draft: chain: other", "verify: rewind", "verify: mask",
                "verify: target forward", "verify: taps", "verify: other", "gaps", "context append", "acceptance")
PLAIN_STAGES = ("verify: rewind", "verify: mask", "verify: target forward", "verify: other", "pick")


class Stages:
    """The stage stack: `range(name)` opens a profiler range and makes `name` the current stage."""

    def __init__(self):
        self.stack: list[str] = []

    @contextlib.contextmanager
    def range(self, name: str):
        self.stack.append(name)
        try:
            with record_function(PREFIX + name):
                yield
        finally:
            self.stack.pop()

    def wrap(self, fn, name: str):
        def wrapped(*args, **kwargs):
            with self.range(name):
                return fn(*args, **kwargs)
        return wrapped


class HostReads(TorchFunctionMode):
    """Counts the tensor methods that read a value on the host, per current stage."""

    def __init__(self, stages: Stages):
        super().__init__()
        self.stages, self.counts = stages, collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.counts[self.stages.stack[-1] if self.stages.stack else "outside"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def patched(pairs):
    """Set (owner, attribute, value) for the block, restoring every original after."""
    saved = [(owner, attr, owner.__dict__.get(attr, _ABSENT)) for owner, attr, _ in pairs]
    try:
        for owner, attr, value in pairs:
            setattr(owner, attr, value)
        yield
    finally:
        for owner, attr, old in reversed(saved):
            if old is _ABSENT:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)


_ABSENT = object()


def _head_modules(drafter) -> list:
    """The drafter's own modules outside the backbone (a head's bias, selector, GRU...), as leaves."""
    backbone = drafter.backbone_prefixes + ("norm", "hidden_norm")
    return [m for name, m in drafter.named_modules()
            if name and not name.startswith(backbone) and not any(True for _ in m.children())]


def instrument(dec: StaticDecoder, stages: Stages):
    """The (owner, attribute, wrapper) triples that name every stage of `dec`'s steps (module doc)."""
    d, w = dec.drafter, stages.wrap
    pairs = [(dec, "_prefill", w(dec._prefill, "prefill")), (dec, "_draft", w(dec._draft, "draft: block inputs")),
             (dec, "_draft_masks", w(dec._draft_masks, "draft: masks")),
             (d, "run_layers", w(d.run_layers, "draft: backbone")), (d, "propose", w(d.propose, "draft: chain: other")),
             (dec, "_rewind", w(dec._rewind, "verify: rewind")),
             (dec, "_target_mask", w(dec._target_mask, "verify: mask")), (dec, "_target", w(dec._target, "verify: other")),
             (dec.model, "forward", w(dec.model.forward, "verify: target forward")),
             (static_decode, "select_taps", w(static_decode.select_taps, "verify: taps")),
             (static_decode, "top2_gap", w(static_decode.top2_gap, "gaps")),
             (dec, "_append_context", w(dec._append_context, "context append")),
             # what a GPU runs: the CPU-only few-row matmul route off
             (few_rows, "few_row_mode", lambda *a: contextlib.nullcontext()), (few_rows, "FEW_ROWS", (2, 1))]
    pairs += [(m, "forward", w(m.forward, "draft: chain: head modules")) for m in _head_modules(d)]
    if hasattr(dec.head, "scores"):  # its halves apart, so a head that scores its slots at once still does
        pairs += [(dec.head, "scores", w(dec.head.scores, "draft: chain: lm_head")),
                  (dec.head, "logits", w(dec.head.logits, "draft: chain: logits"))]
    else:  # a tree before the split (the census before issue 37's changes)
        pairs.append((dec, "head", w(dec.head, "draft: chain: lm_head")))
    for b in dec.buckets.values():  # the steps each bucket's CapturedStep holds (built by the warm-up)
        pairs += [(b.cycle, "step", w(b.cycle.step, "acceptance")), (b.plain, "step", w(b.plain.step, "pick"))]
    return pairs


def _stage_of(event) -> tuple[str | None, bool]:
    """(innermost census stage above an aten event, or "prefill" for all of the prefill's; whether no aten
    op sits between them)."""
    top, stage, parent = True, None, event.cpu_parent
    while parent is not None:
        if parent.name.startswith(PREFIX):
            stage = stage or parent.name[len(PREFIX):]
            if parent.name == PREFIX + "prefill":
                return "prefill", top
        elif parent.name.startswith("aten::") and stage is None:
            top = False
        parent = parent.cpu_parent
    return stage, top


def _computes(event, memo: dict) -> bool:
    """Whether an aten op launches work: it is no view, no-op cast or allocation, or something below it is."""
    key = id(event)
    if key not in memo:
        memo[key] = event.name not in NO_KERNEL or any(_computes(c, memo) for c in event.cpu_children
                                                       if c.name.startswith("aten::"))
    return memo[key]


def census(prof, reads: collections.Counter) -> dict[str, dict]:
    """{stage: {calls, kernels, reads, launches, device_us, ops}} of one profiled run: `calls` the aten ops
    called from Python (none above them), `kernels` those of them that launch work, `ops` a Counter of the
    latter's names; on CUDA, `launches` the device kernels (and copies) the profiler saw and `device_us`
    their summed durations (zero on the CPU)."""
    out: dict[str, dict] = collections.defaultdict(lambda: dict({k: 0 for k in FIGURES}, ops=collections.Counter()))
    memo: dict = {}
    for e in prof.events():
        kernels = getattr(e, "kernels", None) or ()  # on CUDA: the device kernels this op launched, timed
        if kernels and not e.name.startswith(PREFIX):
            row = out[_stage_of(e)[0] or "loop (host)"]
            row["launches"] += len(kernels)
            row["device_us"] += sum(k.duration for k in kernels)
        if not e.name.startswith("aten::"):
            continue
        stage, top = _stage_of(e)
        row = out[stage or "loop (host)"]
        if e.name == "aten::nonzero":
            row["reads"] += 1
        if not top:
            continue
        row["calls"] += 1
        if _computes(e, memo):
            row["kernels"] += 1
            row["ops"][e.name] += 1
    for stage, n in reads.items():
        out["loop (host)" if stage == "outside" else stage]["reads"] += n
    return dict(out)


def profiled(dec: StaticDecoder, run) -> tuple[dict, object]:
    """One decode `run(dec)` with every stage named: (census, its result)."""
    stages = Stages()
    reads = HostReads(stages)
    with patched(instrument(dec, stages)), torch.no_grad():
        cuda = dec.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof, reads:
            result = run(dec)
            if cuda:
                torch.cuda.synchronize()
    return census(prof, reads.counts), result


def per(table: dict, stage: str, n: int, bench: Bench, key: str) -> dict[str, float]:
    row = table.get(stage, {k: 0 for k in FIGURES})
    for name in ("calls", "kernels"):
        if row[name] % n:
            bench.log(f"note: {key} '{stage}' ran {row[name]} {name} over {n} steps: not the same every step")
    return {name: row[name] / n for name in FIGURES}


def build(args):
    target = load_target("smollm2", dtype=getattr(torch, args.dtype), device=args.device)
    cfg = recipes.gpu()
    cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, arch=args.arch))  # its shape, this head
    dcfg = build_drafter_config(cfg, target)
    drafter = build_drafter(dcfg)
    drafter.reset_parameters(generator=torch.Generator().manual_seed(0))
    drafter = drafter.to(args.device, target.dtype).eval().requires_grad_(False)
    head = DraftHead.of(target.lm_head_weight, None, dcfg.scaling)
    dec = StaticDecoder(target.model, drafter, target.embed_weight, head, dcfg.target_layer_ids, dcfg.block_size,
                        args.max_new_tokens, use_graph=False)
    text = target.tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    prompt = target.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(args.device)
    return dec, prompt, dcfg


def table(bench: Bench, rows: dict, ops: int, cuda: bool) -> None:
    gpu = f" {'launch':>7s} {'dev us':>7s}" if cuda else ""
    bench.log(f"{'stage':34s} {'on a GPU':9s} {'calls':>7s} {'kernels':>7s} {'reads':>5s}{gpu}  top kernel ops")
    for key, (where, fig, detail, n) in rows.items():
        top = ", ".join(f"{name.removeprefix('aten::')} {c / n:g}" for name, c in detail.most_common(ops)) \
            if detail else ""
        gpu = f" {fig['launches']:7.1f} {fig['device_us']:7.1f}" if cuda else ""
        bench.log(f"{key:34s} {where:9s} {fig['calls']:7.1f} {fig['kernels']:7.1f} {fig['reads']:5.1f}{gpu}  {top}")


def _key(stage: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in stage).strip("_").replace("__", "_").replace("__", "_")


def summarise(bench: Bench, tabs: dict, counts: dict) -> dict[str, dict]:
    """Per step of each kind ("plain", "cycle"): the stage rows, figures and totals; the table printed."""
    rows: dict[str, tuple] = {}
    totals = {}
    for kind, stages in (("plain", PLAIN_STAGES), ("cycle", CYCLE_STAGES)):
        tab, n = tabs[kind], counts[kind]
        total = {k: 0.0 for k in FIGURES}
        for stage in stages + ("loop (host)",):
            fig = per(tab, stage, n, bench, kind)
            rows[f"{kind}: {stage}"] = ("outside" if stage == "loop (host)" else "in graph", fig,
                                        tab.get(stage, {}).get("ops"), n)
            for name in total:
                total[name] += fig[name]
            bench.figure(f"{kind}_{_key(stage)}_kernels", fig["kernels"])
        rows[f"{kind}: total"] = ("", total, None, n)
        totals[kind] = total
        for stage in ("prefill", "loop (per prompt)"):
            once = tab.get(stage, {k: 0 for k in FIGURES})
            rows[f"{kind}: {stage.replace('prefill', 'prefill (per prompt)')}"] = (
                "outside", {k: float(once[k]) for k in total}, once.get("ops"), 1)
    table(bench, rows, bench.args.ops, bench.args.device == "cuda")
    return totals


def per_prompt_apart(tab: dict, once: dict) -> dict:
    """The loop's work of a run apart from what it does once per prompt (`once`: the same decode of one
    token, no step: the first token's read, the result's reads), as "loop (per prompt)"."""
    tab = dict(tab)
    loop, base = tab.get("loop (host)"), once.get("loop (host)")
    if loop is not None and base is not None:
        tab["loop (host)"] = dict({k: loop[k] - base[k] for k in FIGURES}, ops=loop["ops"] - base["ops"])
        tab["loop (per prompt)"] = base
    return tab


def run_census(args, bench: Bench) -> tuple[float, float, StaticDecoder, torch.Tensor]:
    """The census table; (kernels per cycle / per plain step, the same for calls, the decoder, the prompt)."""
    dec, prompt, dcfg = build(args)
    bench.log(f"drafter {args.arch}: {dcfg.num_layers} layers x {dcfg.hidden_size}, block {dcfg.block_size} "
              f"(drafts {dec.drafted}), {', '.join(sorted(set(dcfg.layer_types)))}; prompt {prompt.shape[1]} tokens, "
              f"{args.max_new_tokens} new, {args.dtype}")
    with torch.no_grad():  # warm-up: lazy initialisations stay out of the counts
        dec.plain(prompt, args.max_new_tokens, [])
        dec.speculative(prompt, args.max_new_tokens, [])
    plain_t, plain = profiled(dec, lambda d: d.plain(prompt, args.max_new_tokens, []))
    spec_t, spec = profiled(dec, lambda d: d.speculative(prompt, args.max_new_tokens, []))
    plain_t = per_prompt_apart(plain_t, profiled(dec, lambda d: d.plain(prompt, 1, []))[0])
    spec_t = per_prompt_apart(spec_t, profiled(dec, lambda d: d.speculative(prompt, 1, []))[0])
    counts = {"plain": len(plain.tokens) - 1, "cycle": len(spec.accepted)}
    bench.log(f"plain: {counts['plain']} steps; speculative: {counts['cycle']} cycles, tau {spec.tau:.2f} "
              "(figures per step; the prefill's and the loop's once-per-prompt work apart)")
    totals = summarise(bench, {"plain": plain_t, "cycle": spec_t}, counts)
    for name in FIGURES if args.device == "cuda" else FIGURES[:3]:
        bench.figure(f"plain_{name}", totals["plain"][name], "per plain step")
        bench.figure(f"cycle_{name}", totals["cycle"][name], "per cycle")
    kernels = totals["cycle"]["kernels"] / totals["plain"]["kernels"]
    calls = totals["cycle"]["calls"] / totals["plain"]["calls"]
    bench.figure("cycle_over_plain_kernels", kernels, "kernel ops per cycle / per plain step")
    bench.figure("cycle_over_plain_calls", calls, "aten calls per cycle / per plain step")
    if args.device == "cuda":
        bench.figure("cycle_over_plain_device_us", totals["cycle"]["device_us"] / totals["plain"]["device_us"],
                     "summed kernel durations per cycle / per plain step (eager, profiled)")
    return kernels, calls, dec, prompt


def graph_replays(args, bench: Bench, eager: StaticDecoder, prompt) -> float:
    """CUDA only: the same pair through CUDA graphs (`use_graph=True`), each replay of the cycle and plain
    graphs (and each eager prefill) timed with CUDA events; the captures checked."""
    dec = StaticDecoder(eager.model, eager.drafter, eager.embed_weight, eager.head, eager.layer_ids, eager.block,
                        args.max_new_tokens)
    with torch.no_grad():  # captures the bucket's graphs
        dec.plain(prompt, args.max_new_tokens, [])
        dec.speculative(prompt, args.max_new_tokens, [])
    for b in dec.buckets.values():
        captured = {"cycle": b.cycle.graph is not None, "plain": b.plain.graph is not None}
        bench.log(f"bucket {b.length}: graphs captured {captured}")
        bench.figure("graphs_captured", float(all(captured.values())), "1: both steps replay as CUDA graphs")
    spans: dict[str, list] = collections.defaultdict(list)

    def timed(fn, name):
        def call(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*a, **k)
            end.record()
            spans[name].append((start, end))
            return out
        return call

    pairs = [(dec, "_prefill", timed(dec._prefill, "prefill"))]
    pairs += [(b, kind, timed(getattr(b, kind), kind)) for b in dec.buckets.values() for kind in ("cycle", "plain")]
    with patched(pairs), torch.no_grad():
        for _ in range(args.rounds):
            dec.plain(prompt, args.max_new_tokens, [])
            spec = dec.speculative(prompt, args.max_new_tokens, [])
    torch.cuda.synchronize()
    ms = {name: sorted(s.elapsed_time(e) for s, e in v)[len(v) // 2] for name, v in spans.items()}
    for name, value in ms.items():
        bench.figure(f"graph_{name}_ms", value, f"median of {len(spans[name])} (CUDA events)")
    ratio = ms["cycle"] / ms["plain"]
    bench.figure("graph_cycle_over_plain", ratio, "replayed cycle graph / replayed plain graph (goal <= 1.5)")
    bench.figure("spec_ms_per_cycle_end_to_end", 1e3 * spec.seconds / max(len(spec.accepted), 1),
                 "the last speculative call: prefill + loop, per cycle")
    return ratio


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="dspark", choices=sorted(HEADS))
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ops", type=int, default=6, help="kernel op names shown per stage")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: also the kernels and their durations per stage, and the graphs' replay times")
    p.add_argument("--rounds", type=int, default=5, help="cuda: timed decodes of each kind")
    p.add_argument("--small", action="store_true", help="a smoke run: 6 new tokens")
    p.add_argument("--json")
    args = p.parse_args()
    if args.small:
        args.max_new_tokens = 6
    bench = Bench("decode_census", args)
    bench.info.update(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                      threads=torch.get_num_threads())
    found, replayed = (float("nan"), float("nan"), None, None), ""
    with bench.phase("census"):
        found = run_census(args, bench)
    if args.device == "cuda" and bench.ok("census"):
        with bench.phase("graph replays"):
            replayed = f"; replayed as CUDA graphs, a cycle takes {graph_replays(args, bench, *found[2:]):.2f} plain steps"
    return bench.finish(f"a {args.arch} cycle runs {found[0]:.2f}x the kernel ops of a plain step ({found[1]:.2f}x "
                        f"the aten calls){replayed}", args.json)


if __name__ == "__main__":
    raise SystemExit(main())
