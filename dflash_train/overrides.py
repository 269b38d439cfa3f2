"""Reading and writing the config tree (config.py): `section.field=value` overrides parsed by each
field's type, a checkpoint's dict back into a RunConfig, the fields' docstrings for --help, and the
helpers that describe a field's type. The tree and its defaults live in config.py alone."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from typing import Literal

from dflash_train.config import ConfigError, RunConfig


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in RunConfig order."""
    return {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}  # type: ignore[misc]


def field_types(section_cls: type) -> dict[str, object]:
    """Field name -> its resolved type (Literal, `X | None`, tuple[...] as real typing objects)."""
    return typing.get_type_hints(section_cls)


def settings(cfg: RunConfig) -> list[tuple[str, object, object]]:
    """Every `(section.field, value, type)` of a config, in declaration order."""
    out = []
    for name, cls in sections().items():
        section = getattr(cfg, name)
        for field_name, tp in field_types(cls).items():
            out.append((f"{name}.{field_name}", getattr(section, field_name), tp))
    return out


def _optional_base(tp) -> tuple[object, bool]:
    """`X | None` -> (X, True); anything else -> (tp, False) (`bool | str` stays a union)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def describe_type(tp) -> str:
    """Short readable form of a field type: `int | None`, `one of a|b`, `tuple of int`."""
    base, optional = _optional_base(tp)
    if typing.get_origin(base) is Literal:
        text = "one of " + "|".join(typing.get_args(base))
    elif typing.get_origin(base) is tuple:
        text = "tuple of " + typing.get_args(base)[0].__name__ + " (a,b,...)"
    else:
        text = getattr(base, "__name__", str(base))
    return f"{text} | None" if optional else text


def allowed_values(tp) -> tuple[str, ...] | None:
    """The values a Literal field (optional or not) allows; None for other types."""
    base, _ = _optional_base(tp)
    return typing.get_args(base) if typing.get_origin(base) is Literal else None


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _parse_value(text: str, tp, key: str):
    """Parse one override value by the field's type; a bad value names the key and the type."""
    base, optional = _optional_base(tp)
    if optional and text.lower() in ("none", "null"):
        return None
    choices = allowed_values(base)
    if choices is not None:
        if text not in choices:
            raise ConfigError(f"{key}={text!r}: expected one of {', '.join(choices)}")
        return text
    try:
        if base is bool or typing.get_args(base) == (bool, str):  # bool | str: a switch, or a path
            if text.lower() not in _TRUE + _FALSE:
                if base is bool:
                    raise ValueError(text)
                return text
            return text.lower() in _TRUE
        if base in (int, float, str):
            return base(text)
        if typing.get_origin(base) is tuple:
            cast = typing.get_args(base)[0]
            return tuple(cast(x.strip()) for x in text.strip("()[] ").split(",") if x.strip())
    except ValueError as e:
        raise ConfigError(f"override {key}={text!r}: expected {describe_type(tp)}") from e
    raise ConfigError(f"override {key}: unsupported field type {tp}")


def apply_overrides(cfg: RunConfig, overrides: typing.Sequence[str]) -> RunConfig:
    """Return a new RunConfig with `section.field=value` overrides applied in order; unknown keys raise
    a ConfigError that lists the valid ones."""
    known = sections()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.field=value")
        key, text = item.split("=", 1)
        if key.count(".") != 1:
            raise ConfigError(f"override {key!r}: expected section.field (sections: {', '.join(known)})")
        section_name, field_name = key.split(".")
        if section_name not in known:
            raise ConfigError(f"unknown config section {section_name!r}; valid: {', '.join(known)}")
        types_ = field_types(known[section_name])
        if field_name not in types_:
            raise ConfigError(f"unknown config key {key!r}; valid keys in {section_name}: {', '.join(types_)}")
        value = _parse_value(text, types_[field_name], key)
        section = getattr(cfg, section_name)
        cfg = dataclasses.replace(cfg, **{section_name: dataclasses.replace(section, **{field_name: value})})
    return cfg


def from_dict(data: dict) -> RunConfig:
    """Rebuild a RunConfig from `to_dict` output (a checkpoint's config.json); unknown keys raise.
    A section missing from `data` (a config written before it existed) takes its defaults."""
    kwargs = {}
    for name, section_cls in sections().items():
        values = dict(data.get(name, {}))
        unknown = set(values) - set(field_types(section_cls))
        if unknown:
            raise ConfigError(f"unknown config keys in {name}: {sorted(unknown)}")
        for k, v in list(values.items()):
            if isinstance(v, list):
                values[k] = tuple(v)
        kwargs[name] = section_cls(**values)
    extra = set(data) - set(kwargs)
    if extra:
        raise ConfigError(f"unknown config sections: {sorted(extra)}")
    return RunConfig(**kwargs)


def field_docs() -> dict[str, str]:
    """`section.field` -> the docstring written under that field where it is declared (config.py, or a
    head's file for the drafter's head settings), for --help."""
    docs = {}
    for section, cls in sections().items():
        for declaring in reversed(cls.__mro__[:-1]):  # bases first: a field's own class documents it
            docs.update({f"{section}.{name}": doc for name, doc in _class_field_docs(declaring).items()})
    return docs


def _class_field_docs(cls: type) -> dict[str, str]:
    """field -> the string literal right under its annotated assignment in `cls`'s own body."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    docs = {}
    for stmt, after in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs
