"""The head registry (model/drafter/heads/architectures.py): every registered head, whatever it is, has its settings
in the config tree once (overrides, --help, the dict round trip, checks), its tables kept from Muon,
its parameters counted by the plan (against the built module), an export that reads back and passes
the serving check, and greedy speculative decoding equal to the target's greedy decoding. DSpark's
Markov head forms run through the same tests."""

import ast
import dataclasses
import json
import typing
from pathlib import Path

import pytest
import torch

from dflash_train import cli, plan
from dflash_train.config import DrafterConfigSpec, RunConfig, block_size_of
from dflash_train.eval.spec_decode import speculative_generate, target_generate
from dflash_train.model.drafter.heads import architectures
from dflash_train.model.drafter.heads.architectures import HEAD_NAMES, HEADS, SETTING_OWNERS, build_drafter, head
from dflash_train.model.drafter.config import DrafterConfig, drafter_config_from_target
from dflash_train.model.drafter.export.export import export_drafter
from dflash_train.model.drafter.export.hf_format import load_zlab, speculators_config_dict
from dflash_train.model.drafter.export.check import ServingContractError, check_drafter
from dflash_train.model.drafter.export.serve import engine_notes, serve_instructions
from dflash_train.model.target.identity import describe_target
from dflash_train.overrides import apply_overrides, from_dict
from dflash_train.train.optim.muon import muon_split
from dflash_train.validate import config_problems
from tests.conftest import tiny_qwen3
from tests.eval.eval_helpers import tiny_target

CASES = [(name, ()) for name in HEAD_NAMES] + [("dspark", (("markov_head_type", "gated"),)),
                                               ("dspark", (("markov_head_type", "rnn"),))]
"""Every registered head, and the forms of a head chosen by a setting."""
IDS = [name + "".join(f"-{v}" for _, v in extra) for name, extra in CASES]


def head_config(target_config, name: str, extra=(), block: int = 4, **kw) -> DrafterConfig:
    """A small drafter config of head `name` for a target: its `small` settings, then `extra`."""
    settings = dict(head(name).small) | dict(extra)
    return drafter_config_from_target(target_config, num_layers=kw.pop("layers", 2), block_size=block,
                                      mask_token_id=3, num_taps=2, arch=name, head_settings=settings, **kw)


def off_neutral(drafter, seed: int = 0, scale: float = 0.3):
    """Every parameter moved off its initialisation (heads start neutral: a zero bias, identity
    convolutions), so each one changes the drafts."""
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return drafter


def test_every_head_is_declared_once_and_the_config_tree_lists_it():
    spec_fields = {f.name: f.default for f in dataclasses.fields(DrafterConfigSpec)}
    model_fields = {f.name: f.default for f in dataclasses.fields(DrafterConfig)}
    assert typing.get_args(typing.get_type_hints(DrafterConfigSpec)["arch"]) == HEAD_NAMES
    for h in HEADS.values():
        assert issubclass(h.module, architectures.DFlashDrafter) and h.published_block >= 2
        assert block_size_of(dataclasses.replace(DrafterConfigSpec(), arch=h.name)) == h.published_block
        for name, default in h.setting_defaults().items():
            assert SETTING_OWNERS[name] == h.name
            assert spec_fields[name] == model_fields[name] == default  # one source of defaults
    assert set(SETTING_OWNERS) <= set(spec_fields) and set(SETTING_OWNERS) <= set(model_fields)


def test_every_head_setting_is_an_override_with_its_help_and_survives_the_checkpoint_round_trip(capsys):
    cfg = RunConfig()
    for h in HEADS.values():
        for name, value in h.small:
            cfg = apply_overrides(cfg, [f"drafter.{name}={value}"])
            assert getattr(cfg.drafter, name) == value
    assert from_dict(json.loads(cfg.to_json())) == cfg
    older = json.loads(RunConfig().to_json())
    for name in SETTING_OWNERS:  # a checkpoint written before a head existed: its settings take their defaults
        older["drafter"].pop(name)
    assert from_dict(older) == RunConfig()
    assert cli.main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for name, owner in SETTING_OWNERS.items():
        assert f"drafter.{name} = " in text and f"{owner}: " in text


def test_each_head_checks_its_own_settings_by_name():
    for name in SETTING_OWNERS:
        value = getattr(RunConfig().drafter, name)
        if isinstance(value, int) and not isinstance(value, bool):
            bad = apply_overrides(RunConfig(), [f"drafter.{name}=0"])
            assert f"drafter.{name}=0: must be > 0" in config_problems(bad)
    assert config_problems(RunConfig()) == []


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_the_plan_counts_every_head_s_parameters_as_the_built_module_has_them(name, extra):
    target = tiny_qwen3(vocab_size=97).config
    for settings in (dict(head(name).small) | dict(extra), dict(extra)):  # small and default sizes
        cfg = drafter_config_from_target(target, num_layers=2, block_size=4, mask_token_id=3, num_taps=3, arch=name,
                                         head_settings=settings)
        with torch.device("meta"):
            built = sum(p.numel() for p in build_drafter(cfg).parameters())
        assert plan.drafter_params(cfg) == built


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_muon_leaves_each_head_s_own_tables_to_adamw(name, extra):
    drafter = build_drafter(head_config(tiny_qwen3(vocab_size=97).config, name, extra))
    muon, adamw = muon_split(drafter.named_parameters())
    kept = [n for n, _ in adamw if any(word in n for word in head(name).outside_muon)]
    assert all(any(word in n for n, _ in adamw) for word in head(name).outside_muon) and len(kept) >= len(
        head(name).outside_muon)
    assert not any(word in n for n, _ in muon for word in head(name).outside_muon)
    assert "layers.0.self_attn.q_proj.weight" in {n for n, _ in muon}


@pytest.fixture(scope="module")
def target_info(tiny_qwen3_dir):
    return describe_target(str(tiny_qwen3_dir))


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_every_head_exports_passes_the_check_and_reads_back(tiny_qwen3_target, tiny_qwen3_dir, target_info, tmp_path,
                                                            name, extra):
    drafter = off_neutral(build_drafter(head_config(tiny_qwen3_target.config, name, extra)))
    out = export_drafter(drafter, tmp_path / name, str(tiny_qwen3_dir), dtype=torch.float32)
    assert check_drafter(out, target_info, trained=drafter) == []
    loaded = load_zlab(out)
    assert loaded.config == drafter.config and type(loaded) is type(drafter)
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    text, served = serve_instructions(out), drafter_served(drafter)
    for engine in served:
        assert (engine.method in text) if not engine.refused else (engine.refused in text)
    assert [n for n in engine_notes(out) if "does not serve" in n] == [
        f"{e.name} does not serve this {name} drafter: {e.refused}" for e in served if e.refused]


def drafter_served(drafter):
    return head(drafter.config.arch).served(drafter.config)


def test_a_head_no_engine_serves_is_refused_by_export_and_check(tiny_qwen3_target, tiny_qwen3_dir, tmp_path,
                                                                 monkeypatch):
    """Train and eval only: export (and so `check`) fails naming every engine and its reason."""
    plain = HEADS["dflash"]
    monkeypatch.setitem(architectures.HEADS, "dflash", dataclasses.replace(plain, engines=tuple(
        dataclasses.replace(e, refused=f"{e.name} has no such head") for e in plain.engines)))
    drafter = off_neutral(build_drafter(head_config(tiny_qwen3_target.config, "dflash")))
    with pytest.raises(ServingContractError, match="no engine serves this dflash drafter .*vLLM has no such head.*"
                                                   "SGLang has no such head"):
        export_drafter(drafter, tmp_path / "d", str(tiny_qwen3_dir))


def test_the_speculators_format_refuses_the_heads_it_has_no_place_for():
    target = tiny_qwen3(vocab_size=97).config
    for name, h in HEADS.items():
        cfg = head_config(target, name)
        if h.export.speculators_type is None:
            with pytest.raises(ValueError, match=f"no place for a {name} drafter"):
                speculators_config_dict(cfg, "v", ["Qwen3ForCausalLM"])
        else:
            assert speculators_config_dict(cfg, "v", ["Qwen3ForCausalLM"])["speculators_model_type"] == \
                h.export.speculators_type


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_greedy_speculative_decoding_equals_greedy_decoding_for_every_head(name, extra):
    """Each head's walk (off its neutral start, so it steers the drafts) stays lossless, at block 4 and 3."""
    target = tiny_target(seed=0, layers=6)  # float64: the argmax never flips between a 1- and a B-token forward
    gen = torch.Generator().manual_seed(5)
    for block in (4, 3):
        drafter = off_neutral(build_drafter(head_config(target.config, name, extra, block=block)), seed=block).double()
        drafter.eval()
        for n in (5, 11):
            prompt = torch.randint(0, 90, (1, n), generator=gen)
            plain = target_generate(target, prompt, 20, [])
            spec = speculative_generate(target, drafter, target.get_input_embeddings().weight,
                                        target.get_output_embeddings().weight, drafter.config.target_layer_ids,
                                        prompt, 20, [])
            assert spec.tokens == plain.tokens and max(spec.accepted) <= drafter.drafted(block)


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_training_s_teacher_forced_walk_reproduces_real_decoding_for_every_head(name, extra):
    """The simulated walk (training's forward and the head's teacher-forced `greedy`, whole blocks at a
    time) accepts what real speculative decoding (the head's own `propose` walk) accepts, step by step."""
    from dflash_train.train.watch.simulate import simulated_walks
    from tests.train.watch.test_simulate import LIKELY, _ctx, _peaked_target

    target = _peaked_target()
    drafter = off_neutral(build_drafter(head_config(target.config, name, extra, layers=1)), seed=1,
                          scale=0.05).double().eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the head's tables over the vocabulary pick among the target's likely tokens: it steers
        for param_name, p in drafter.named_parameters():
            if p.shape[0] == target.vocab_size and not param_name.startswith(drafter.backbone_prefixes):
                rows = torch.randn(len(LIKELY), *p.shape[1:], generator=gen, dtype=p.dtype) * 3.0
                p.zero_()[LIKELY] = rows
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 90, (1, n), generator=g) for n in (6, 9, 13)]
    real = [speculative_generate(target.model, drafter, target.embed_weight, target.lm_head_weight,
                                 drafter.config.target_layer_ids, p, 40, []) for p in prompts]
    steps = [a for r in real for a in r.accepted]
    assert len(set(steps)) >= 2, f"the test needs uneven acceptance, got {steps}"
    pairs = [(p[0].tolist(), r.tokens) for p, r in zip(prompts, real)]
    walks, _ = simulated_walks(drafter, target, _ctx(target, drafter), pairs)
    for walk, r in zip(walks, real):
        assert walk[:-1] == r.accepted[:-1] and len(walk) == len(r.accepted) and walk[-1] <= r.accepted[-1]


def test_the_memory_plan_of_a_run_counts_its_head():
    """`dflash-train plan drafter.arch=...`: the run's head reaches the drafter's state (14 or 18 B a parameter)."""
    shape = plan.target_shape(plan.load_target_config("qwen3-8b"))
    states = {}
    for name in HEAD_NAMES:
        run = plan.RunShape.from_run_config(apply_overrides(RunConfig(), [f"drafter.arch={name}"]))
        d = plan.drafter_config(shape, run)
        assert d.arch == name and run.drafted == head(name).module.drafted(run.block_size)
        states[name] = plan.drafter_memory(shape, run).parts["state"]
        per_param = plan.DRAFTER_STATE_BYTES + (plan.GRAD_BYTES if run.grad_accum > 1 else 0)
        assert states[name] == per_param * plan.drafter_params(d)
    assert all(states[name] > states["dflash"] for name in HEAD_NAMES if HEADS[name].parameters is not
               HEADS["dflash"].parameters)


HEAD_FILES = {"model/drafter/backbone.py", "model/drafter/shape.py", "model/drafter/heads/architectures.py"}
"""The base head's file, the one default of `drafter.arch`, the registry; the head files under heads/ too."""
CHOOSERS = {"recipes.py"}
"""Files that choose a head the way a user does, by name (a recipe is configuration)."""


PACKAGE = Path(architectures.__file__).resolve().parents[3]  # dflash_train/


def _head_names_outside_the_heads(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in HEAD_FILES | CHOOSERS or rel.startswith("model/drafter/heads/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in HEADS:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
            elif isinstance(node, ast.Compare) and ast.unparse(node.left).split(".")[-1] == "arch":
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_the_heads_and_the_registry_names_a_head():
    """Issue 40's check: no `arch ==` and no head-name string outside the heads, the registry and the recipes."""
    assert _head_names_outside_the_heads(PACKAGE) == []


def test_the_head_name_scan_reports_a_head_name_and_an_arch_comparison(tmp_path):
    """The scan above can fail: a module naming a head and comparing `arch` is reported with its line; the head
    files are not."""
    (tmp_path / "model/drafter/heads").mkdir(parents=True)
    (tmp_path / "model/drafter/heads/mine.py").write_text('NAME = "dspark"\n')
    (tmp_path / "export.py").write_text('def f(cfg):\n    return cfg.arch == "domino"\n')
    assert _head_names_outside_the_heads(tmp_path) == ["export.py:2: cfg.arch == 'domino'", "export.py:2: 'domino'"]
