"""The registry of drafter heads: the one list every consumer derives the heads from.

Each head is one file that declares everything about itself (model/drafter/head.py: `Head`); adding a head
is its file, its import and its entry below. From this list come the config tree's `drafter.arch` choices and
`drafter.*` head settings (config.py, model/drafter/config.py), their checks (validate.py), the block a head
is published with, the parameters Muon leaves to AdamW (train/optim/muon.py), the plan's parameter counts
(plan.py), the export and `check` rules (model/drafter/export/hf_format.py, model/drafter/export/check.py), the benches'
choices and the tests' parametrisations. Nothing else asks which head trains.
"""

from __future__ import annotations

from dflash_train.model.drafter.heads import dflash2, domino, dspark
from dflash_train.model.drafter import backbone as drafter
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.drafter.shape import DrafterShape
from dflash_train.model.drafter.head import Head

HEADS: dict[str, Head] = {h.name: h for h in (drafter.HEAD, dflash2.HEAD, dspark.HEAD, domino.HEAD)}
"""Name -> head, in the order the CLI lists them."""
HEAD_NAMES = tuple(HEADS)
SETTINGS = tuple(h.settings for h in HEADS.values() if h.settings is not None)
"""Every head's settings dataclass: the config tree and DrafterConfig inherit their fields."""


def _owners() -> dict[str, str]:
    owners = {}
    for head in HEADS.values():
        for name in head.setting_names():
            if name in owners:  # two heads' settings would silently merge in the config tree
                raise ValueError(f"heads {owners[name]} and {head.name} both declare the setting {name!r}")
            owners[name] = head.name
    return owners


SETTING_OWNERS = _owners()
"""Head setting -> the head that declares it."""


def head(name: str) -> Head:
    """The registered head `name`; a ValueError listing the heads otherwise."""
    if name not in HEADS:
        raise ValueError(f"drafter head {name!r}: expected one of {', '.join(HEADS)}")
    return HEADS[name]


def build_drafter(cfg: DrafterShape) -> DFlashDrafter:
    """The drafter module of cfg.arch (parameters uninitialised: call `reset_parameters`)."""
    return head(cfg.arch).module(cfg)


def head_settings(values) -> dict:
    """Every head's settings read off `values` (a DrafterConfig or the config tree's drafter section)."""
    return {name: getattr(values, name) for name in SETTING_OWNERS}


def others_at_defaults(name: str) -> dict:
    """The settings of every head but `name`, at their defaults: a config carries only its own head's."""
    return {setting: HEADS[owner].setting_defaults()[setting]
            for setting, owner in SETTING_OWNERS.items() if owner != name}


def setting_problems(values, hidden_size: int | None = None, only: str | None = None) -> list[str]:
    """What cannot work in the heads' settings of `values` (every head's, or head `only`'s), by field."""
    heads = [head(only)] if only else HEADS.values()
    return [problem for h in heads for problem in h.problems(values, hidden_size)]


def outside_muon() -> tuple[str, ...]:
    """Words in the names of head parameters that AdamW keeps instead of Muon (each head's own)."""
    return tuple(word for h in HEADS.values() for word in h.outside_muon)


def _place(d: dict, key: str):
    """A key as the engines look for it: `dflash_config` first, then the top level."""
    dflash = d.get("dflash_config") or {}
    return dflash.get(key, d.get(key))


def head_of_config(d: dict, source: str = "config.json", absent: tuple[str, ...] = ()) -> Head:
    """The head a checkpoint's config.json describes: its `architectures` (`absent` where it has none),
    and among heads sharing those the one whose marks it carries; a ValueError naming the file otherwise."""
    names = list(d.get("architectures") or absent)
    named = [h for h in HEADS.values()
             if names in [list(h.export.architectures), *map(list, h.export.also_read)]]
    marked = [h for h in named if all(_place(d, key) == value for key, value in h.export.marks)]
    if marked:
        return max(marked, key=lambda h: len(h.export.marks))
    known = ", ".join(f"{list(h.export.architectures)}" for h in HEADS.values())
    raise ValueError(f"{source}: architectures {names!r} is not a drafter this trainer reads ({known})")


PLAIN = ("DFlashDraftModel",)
"""What a config.json without `architectures` is read as (z-lab's older drafters)."""
