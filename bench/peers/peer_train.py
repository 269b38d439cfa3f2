#!/usr/bin/env python3
"""The peer at equal data and GPU time: speculators 0.9.0's own DSpark (or DFlash) trained on the very samples
and taps our recipe builds, for the recipe's training minutes on this GPU, then measured by our eval.

After `dflash-train train --recipe gpu <overrides>` has built its data, on the same machine and with the same
overrides (README.md in this folder: the wheels and the exact commands):
    PYTHONPATH=$SITE python3 bench/peers/peer_train.py --recipe gpu <overrides> [--model dspark|dflash]
It prints its progress (steps, loss, rate, ETA), writes <train.out_dir>/peer-<model>/ (speculators'
checkpoint, our eval's report, summary.json) and ends with `peer_train: OK ...` or `peer_train: FAILED: ...`.

Theirs (imported from the installed speculators 0.9.0 wheel, nothing copied): the defaults of their trainer
(`TrainConfig(speculator_type=...)`: for dspark block 8, 5 layers, sliding window 2048 causal inside the block,
KL loss, fixed exponential decay gamma 4 (their D-PACE default applies to dflash only), Markov head rank 256,
confidence head weight 1.0, 512 anchors per packed row of 8192 tokens, Muon + AdamW lr 1e-3, linear schedule
with 1 % warm-up), the model built by their `build_draft_model`, their loss (`get_trainer_kwargs`), their
optimizers (`build_optimizers`), scheduler steps (`_resolve_scheduler_steps`), packing sampler and collate, a
step as `Trainer.train_epoch` runs one (bf16 autocast over fp32 weights, clip 1.0), `save_pretrained`.
Ours: the samples (peer_data.py), the wall-clock budget (our `TimeBudget`: the same rule as our trainer's:
the schedule's length decided from the step rate after 30 steps), the progress lines, and the eval.

Equal data: exactly the training split of our run's regenerate + tap cache (its samples' ids, tokens and loss
masks, the target's taps and final hidden states as stored); the held-out samples stay unseen. Equal GPU time:
the same minutes of wall clock from the first step (compilation included) to the last, on the same GPU, as our
trainer's budget counts them; loading, export and eval are outside it for both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO)]
import peer_env  # noqa: E402
from dflash_train.atomic import write_text  # noqa: E402

LOG_PREFIX = "peer"


def log(message: str) -> None:
    for line in str(message).splitlines():
        print(f"{LOG_PREFIX}: {line}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="gpu", help="our recipe whose data and minutes the peer gets (default gpu)")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="the same overrides as our run's")
    p.add_argument("--model", choices=("dspark", "dflash"), default="dspark", help="speculators model (default dspark)")
    p.add_argument("--minutes", type=float, default=None, help="training budget (default: the recipe's)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke tests)")
    p.add_argument("--their", action="append", default=[], metavar="field=value",
                   help="a speculators TrainConfig field by its flat name (e.g. max_anchors=2048), JSON value")
    p.add_argument("--loss-impl", choices=("eager", "fused"), default="eager",
                   help="their loss kernels (eager: their fused Triton ones crash under torch.compile on torch 2.11)")
    p.add_argument("--num-workers", type=int, default=None, help="loader workers (default theirs, at most CPUs - 2)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--out", default=None, help="default <train.out_dir>/peer-<model>")
    p.add_argument("--ours", default=None, help="our run's eval report (default <train.out_dir>/eval/report.json)")
    p.add_argument("--eval-only", action="store_true", help="evaluate the peer's saved checkpoint again")
    p.add_argument("--no-eval", action="store_true")
    return p.parse_args(argv)


def resolve_config(args):
    from dflash_train import recipes
    from dflash_train.overrides import apply_overrides

    cfg = apply_overrides(recipes.get(args.recipe), args.overrides)
    minutes = args.minutes if args.minutes is not None else cfg.train.max_minutes
    if minutes is None and args.max_steps is None:
        raise SystemExit("peer_train: FAILED: no budget: the recipe has no train.max_minutes; pass --minutes")
    out = Path(args.out or Path(cfg.train.out_dir) / f"peer-{args.model}")
    return cfg, minutes, out


def load_recipe_data(cfg, minutes):
    """Our target and the training split of the recipe's regenerate + tap cache (built if missing)."""
    from dflash_train.commands import load_configured_target
    from dflash_train.data.dataset import prepare_tapped
    from dflash_train.train import setup

    resolved = []
    target = load_configured_target(cfg, check_tokenizer=lambda tok: resolved.append(setup.resolve_format(cfg, tok, log)))
    cfg = resolved[0]
    if cfg.target.precision == "fp8":
        target.quantize_fp8(log=log)  # the data's key and numerics, as our run built them
    dcfg = setup.build_drafter_config(cfg, target)
    (train, rows), (held_out, _) = prepare_tapped(cfg.data, target, setup.data_source_name(cfg, target),
                                                  list(dcfg.target_layer_ids), Path(cfg.train.out_dir) / "data",
                                                  cfg.train.seed, log, final_hidden=True)
    tokens = sum(len(s) for s in train)
    log(f"equal data: the {len(train)} training samples ({tokens} tokens) of our run's cache, taps of layers "
        f"{list(dcfg.target_layer_ids)} and the target's final hidden states; {len(held_out)} held-out unseen")
    if minutes is not None:
        log(f"equal GPU time: {minutes} minutes from the first step (compile included) to the last, as our budget")
    return cfg, target, dcfg, train, rows, {"train_samples": len(train), "train_tokens": tokens,
                                            "held_out_samples": len(held_out)}


def verifier_dir(cfg) -> str:
    """The target as an HF directory, where speculators reads the verifier's config and frozen weights."""
    from dflash_train.model.target.load import converted_gguf_dir, resolve_target

    path, gguf = resolve_target(cfg.target.model, cfg.target.gguf_file)
    return str(converted_gguf_dir(path, gguf, log=log)) if gguf else path


def their_config(args, cfg, dcfg, verifier: str, out: Path, cuda: bool):
    """speculators' TrainConfig for `args.model`: their defaults, with what our data fixes (the verifier, its
    taps as their hidden_states indices, our mask token), our seed, and the `--their` settings."""
    from speculators.train.config.schema import CONFIG_DESTS, TrainConfig

    flat = {"speculator_type": args.model, "seed": cfg.train.seed, "verifier_name_or_path": verifier,
            "target_layer_ids": [i + 1 for i in dcfg.target_layer_ids], "mask_token_id": dcfg.mask_token_id,
            "data_path": str(out / "no-vocab-mapping"), "save_path": str(out / "checkpoints"),
            "loss_implementation": args.loss_impl,
            "draft_attn_impl": "simple_flex_attention" if cuda else "sdpa"}  # flex has no CPU backward
    for item in args.their:
        key, _, value = item.partition("=")
        if key not in CONFIG_DESTS:
            raise SystemExit(f"peer_train: FAILED: --their {item}: speculators' TrainConfig has no field {key!r}")
        try:
            flat[key] = json.loads(value)
        except json.JSONDecodeError:
            flat[key] = value  # a bare string
    return TrainConfig.from_flat(flat)


def build_their_model(tc):
    """The model as speculators' `train` builds it (full vocabulary: no vocab mapping files in data_path)."""
    import speculators.train.cli as cli
    from speculators.model import SpeculatorModel

    args = argparse.Namespace(**tc.flatten())
    cli.set_seed(args.seed, args.deterministic_cuda)
    d2t, t2d, vocab = cli.parse_vocab_mappings(args)
    cls = SpeculatorModel.registry[args.speculator_type]
    return cli.build_draft_model(args, cls, t2d, d2t, vocab), cls, args


def trainer_config(args, cls):
    """speculators' TrainerConfig, built from the resolved args as their `main` builds it."""
    import torch
    from speculators.train.trainer import TrainerConfig

    train_kw, val_kw = cls.get_trainer_kwargs(**vars(args))
    return TrainerConfig(
        num_epochs=args.epochs, save_path=args.save_path, lr=args.lr, resume_from_checkpoint=False,
        train_call_kwargs=train_kw, val_call_kwargs=val_kw, optimizer=args.optimizer, weight_decay=args.weight_decay,
        muon_lr=args.muon_lr, muon_momentum=args.muon_momentum, muon_weight_decay=args.muon_weight_decay,
        muon_ns_steps=args.muon_ns_steps, muon_adjust_lr_fn=args.muon_adjust_lr_fn, scheduler_type=args.scheduler_type,
        scheduler_warmup_steps=args.scheduler_warmup_steps, scheduler_warmup_ratio=args.scheduler_warmup_ratio,
        scheduler_total_steps=args.scheduler_total_steps, scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles,
        checkpoint_freq=args.checkpoint_freq, save_best=args.save_best,
        hidden_states_dtype=getattr(torch, args.hidden_states_dtype), log_freq=args.log_freq,
        fsdp_shard=args.fsdp_shard, gradient_checkpointing=args.gradient_checkpointing, max_steps=args.max_steps)


def their_schedulers(config, optimizers, steps_per_epoch: int, done: int = 0) -> list:
    """One scheduler per optimizer as `Trainer.setup_optimizer` makes them, advanced to step `done` (a
    budget's decision rebuilds them with `max_steps`: their schedule over the steps the budget allows)."""
    from speculators.train.trainer import _resolve_scheduler_steps
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    if config.scheduler_type == "none":
        return []
    warmup, total = _resolve_scheduler_steps(config, steps_per_epoch)
    schedulers = []
    for opt in optimizers:
        if config.scheduler_type == "linear":
            s = get_linear_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=total)
        else:
            s = get_cosine_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=total,
                                                num_cycles=config.scheduler_num_cosine_cycles)
        for _ in range(done):
            s.step()
        schedulers.append(s)
    return schedulers


def their_step(model, batch: dict, config, optimizers, schedulers, device, recovery):
    """One step as speculators' `Trainer.train_epoch` runs it."""
    import torch

    recovery.consume(batch)
    batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with torch.autocast(device.type, dtype=config.hidden_states_dtype):
        _, loss, metrics = model(**batch, **(config.train_call_kwargs or {}))
    for opt in optimizers:
        opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for opt in optimizers:
        opt.step()
    for s in schedulers:
        s.step()
    return loss, metrics


def progress_line(step: int, planned: int | None, loss, metrics: dict, budget, lr: float) -> str:
    from speculators.train.utils import normalize_counted_metrics

    m = normalize_counted_metrics({k: float(v) for k, v in metrics.items()})
    elapsed = budget.elapsed()
    rate = step / max(elapsed, 1e-9)
    left = (budget.seconds - elapsed) if budget.seconds else ((planned or step) - step) / max(rate, 1e-9)
    extra = " ".join(f"{k} {m[k]:.3f}" for k in ("full_acc", "accept_len", "confidence_loss") if k in m)
    return (f"step {step}/{planned or '?'} loss {loss.item():.4f} {extra} lr {lr:.2e} | {rate:.2f} steps/s, "
            f"{elapsed:.0f}s elapsed, ETA {max(left, 0):.0f}s")


def train(model, loader, config, minutes, max_steps, device, log_every: int) -> dict:
    """Their steps until the budget is spent (or `max_steps`): the schedule's length decided as ours is."""
    from speculators.train.optimizers import build_optimizers
    from speculators.train.recovery import BatchRecoveryCoordinator

    from dflash_train.train.optim.optimizer import TimeBudget

    per_epoch = len(loader)
    cap = min(config.num_epochs * per_epoch, max_steps or 1 << 62)
    budget = TimeBudget(minutes if max_steps is None else None, cap)
    optimizers = build_optimizers(model, config)
    schedulers = their_schedulers(config._replace(max_steps=max_steps), optimizers, per_epoch)
    recovery, step, epoch, tokens = BatchRecoveryCoordinator("training"), 0, 0, 0
    model.train()
    budget.start(0)
    while step < (budget.steps or cap) and not budget.spent():
        loader.batch_sampler.set_epoch(epoch)
        for batch in loader:
            tokens += int((batch["document_ids"] >= 0).sum())
            loss, metrics = their_step(model, batch, config, optimizers, schedulers, device, recovery)
            step += 1
            decided = budget.propose(step)
            if decided is not None:
                budget.record(decided)
                schedulers = their_schedulers(config._replace(max_steps=decided), optimizers, per_epoch, step)
                log(f"step {step}: {minutes} minutes allow {decided} steps at this rate; their schedule now ends there")
            if step % log_every == 0 or step == 1:
                lr = optimizers[0].param_groups[0]["lr"]
                log(progress_line(step, budget.steps or cap, loss, metrics, budget, lr))
            if step >= (budget.steps or cap) or budget.spent():
                break
        epoch += 1
    seconds = budget.elapsed()
    log(f"trained {step} steps ({epoch} epochs of {per_epoch} packed rows, {tokens} tokens) in {seconds / 60:.2f} min")
    return {"steps": step, "seconds": seconds, "tokens": tokens, "steps_per_epoch": per_epoch,
            "final_loss": loss.item()}


def save_checkpoint(model, path: Path, dtype) -> Path:
    """speculators' own checkpoint (`save_pretrained`, weights in its hidden-states dtype as their dry run
    saves them), written into a temporary directory renamed into place."""
    from dflash_train.atomic import atomic_dir

    model.to(dtype)
    with atomic_dir(path, replaceable=lambda _: True) as tmp:  # the bench's own --out/checkpoint: replaced
        model.save_pretrained(tmp)
    log(f"saved speculators' checkpoint {path}")
    return path


def run_eval(args, checkpoint: Path, out: Path) -> dict:
    """Our eval of their checkpoint (read in the speculators format) on the recipe's prompt sets."""
    cmd = [sys.executable, "-m", "dflash_train", "eval", "--recipe", args.recipe, *args.overrides,
           f"eval.drafter={checkpoint}", f"eval.out_dir={out}"]
    log("eval: " + " ".join(cmd))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"our eval of the peer's checkpoint exited {rc}")
    return json.loads((out / "report.json").read_text())


def compare(peer: dict, ours_path: Path) -> tuple[list[str], str]:
    """Per set: the peer's tau, ours, and the difference; and the issue's check (ours >= peer + 0.2)."""
    if not ours_path.is_file():
        lines = [f"{name}: peer tau {f['tau']:.3f}" for name, f in peer["sets"].items()]
        return lines + [f"(no report of ours at {ours_path}: pass --ours)"], "ours not measured"
    ours = json.loads(ours_path.read_text())["sets"]
    lines, margins = [], []
    for name, f in peer["sets"].items():
        if name in ours:
            margins.append(ours[name]["tau"] - f["tau"])
            lines.append(f"{name}: peer tau {f['tau']:.3f}, ours {ours[name]['tau']:.3f} ({margins[-1]:+.3f})")
    if not margins:
        return lines, f"no set in common with {ours_path}"
    ok = min(margins) >= 0.2
    return lines, f"ours >= peer + 0.2 on every set: {'yes' if ok else 'no'} (smallest margin {min(margins):+.3f})"


def describe(args, a) -> str:
    return (f"speculators {peer_env.speculators_version()} {args.model}: {a.num_layers} layers, block {a.block_size}, "
            f"loss {a.loss_fn} ({args.loss_impl}), weighting {a.per_position_loss_weight} gamma "
            f"{a.dflash_decay_gamma}, {a.max_anchors} anchors per {a.total_seq_len}-token row, {a.optimizer} lr "
            f"{a.lr}, {a.scheduler_type} schedule, {a.epochs} epochs at most")


def train_peer(args, cfg, minutes, out: Path) -> dict:
    import torch

    import peer_data
    from dflash_train.commands import device_of
    from dflash_train.model.target.target import norm_factor

    device = torch.device(device_of(cfg))
    cfg, target, dcfg, samples, rows, data = load_recipe_data(cfg, minutes)
    model, cls, a = build_their_model(their_config(args, cfg, dcfg, verifier_dir(cfg), out, device.type == "cuda"))
    config = trainer_config(a, cls)
    log(describe(args, a))
    dataset = peer_data.RecipeSamples(samples, rows, norm_factor(target.final_norm), a.total_seq_len,
                                      config.hidden_states_dtype)
    del target  # the peer trains from the stored taps alone
    model.to(device)
    log(f"teacher: speculators' verifier norm gives back our final hidden state within "
        f"{peer_data.check_teacher(model, dataset):.2%}")
    workers = args.num_workers if args.num_workers is not None else min(a.num_workers, max(os.cpu_count() - 2, 0))
    loader = peer_data.their_loader(dataset, a.total_seq_len, dcfg.hidden_size, dcfg.num_taps, a.seed, workers,
                                    a.prefetch_factor)
    result = train(model, loader, config, minutes, args.max_steps, device, args.log_every)
    save_checkpoint(model, out / "checkpoint", config.hidden_states_dtype)
    return {**result, **data, "minutes": minutes, "their_config": {k: v for k, v in vars(a).items() if _plain(v)}}


def _plain(value) -> bool:
    return isinstance(value, (int, float, str, bool, type(None))) or (
        isinstance(value, list) and all(isinstance(v, (int, float, str)) for v in value))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if peer_env.speculators_version() is None:
            raise RuntimeError("speculators 0.9.0 does not import: install the wheels of bench/peers/fetch_wheels.sh "
                               "(README.md in this folder)")
        cfg, minutes, out = resolve_config(args)
        summary_path = out / "summary.json"
        if args.eval_only:
            summary = json.loads(summary_path.read_text())
        else:
            summary = train_peer(args, cfg, minutes, out)
            write_text(summary_path, json.dumps(summary, indent=1) + "\n")  # before the eval: --eval-only reads it
        if not args.no_eval:
            report = run_eval(args, out / "checkpoint", out / "eval")
            lines, check = compare(report, Path(args.ours or Path(cfg.train.out_dir) / "eval" / "report.json"))
            for line in lines:
                log(line)
            summary.update(eval={n: f["tau"] for n, f in report["sets"].items()}, check=check)
            write_text(summary_path, json.dumps(summary, indent=1) + "\n")
    except Exception as e:  # noqa: BLE001 - the verdict line names any failure
        print(f"peer_train: FAILED: {type(e).__name__}: {e}", flush=True)
        return 1
    taus = ", ".join(f"{n} {t:.3f}" for n, t in summary.get("eval", {}).items()) or "not evaluated"
    print(f"peer_train: OK speculators {args.model}, {summary['steps']} steps in {summary['seconds'] / 60:.2f} min; "
          f"tau {taus}; {summary.get('check', '')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
