"""Config loading: a service's frozen dataclass filled from CLI flags, then RADIXSERVE_* env vars, then defaults.

A field's metadata holds its flag's "help", and optionally its "choices" or a "parse" (text → value, ValueError if
bad): load_config, check_fields and config_argument (which `radixserve serve` uses) all read them from there.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable
from typing import Any, TypeVar

C = TypeVar("C")
ENV_PREFIX = "RADIXSERVE_"


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _caster(tp: Any):
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _caster(args[0])
        return lambda text: None if text.lower() in ("", "none") else inner(text)
    if tp is bool:
        return _parse_bool
    if origin in (list, tuple):
        inner = _caster(typing.get_args(tp)[0])
        return lambda text: [inner(x) for x in text.split(",") if x]
    return tp


def load_config(cls: type[C], argv: list[str] | None = None, description: str = "") -> C:
    """Build cls from `--field-name VALUE` flags and RADIXSERVE_FIELD_NAME env vars (flags win)."""
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=description or cls.__doc__)
    for f in dataclasses.fields(cls):
        env = ENV_PREFIX + f.name.upper()
        help_text = f.metadata.get("help", "") + f" (env {env})"
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=_caster(hints[f.name]),
                            default=None, choices=f.metadata.get("choices"), help=help_text)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        flag = getattr(args, f.name)
        env = os.environ.get(ENV_PREFIX + f.name.upper())
        if flag is not None:
            values[f.name] = flag
        elif env is not None:
            try:
                values[f.name] = _caster(hints[f.name])(env)
            except ValueError as exc:
                parser.error(f"{ENV_PREFIX + f.name.upper()}: {exc}")
    return cls(**values)


def check_fields(config: Any) -> None:
    """ValueError for the first field of config outside its metadata's "choices" or refused by its "parse"."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name} must be {_alternatives(choices)}, not {value!r}")
        if "parse" in f.metadata:
            f.metadata["parse"](value)


def config_argument(parser: argparse.ArgumentParser, cls: type, name: str, flag: str | None = None,
                    **overrides: Any) -> None:
    """Add cls's field `name` to parser as --flag (default: --field-name), with the field's default, help and
    choices, its value checked by the field's "parse"; overrides (e.g. help, metavar) win."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    parse = f.metadata.get("parse")
    kwargs: dict[str, Any] = {
        "default": f.default, "help": f.metadata.get("help"), "choices": f.metadata.get("choices"),
        "type": _checked(parse) if parse else _caster(typing.get_type_hints(cls)[name])}
    parser.add_argument(flag or "--" + name.replace("_", "-"), dest=name, **{**kwargs, **overrides})


def _checked(parse: Callable[[str], Any]) -> Callable[[str], str]:
    """An argparse type that refuses what parse refuses and keeps the text (it is passed on to a service)."""
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return check


def _alternatives(choices: typing.Sequence[str]) -> str:
    return " or ".join(choices) if len(choices) == 2 else "one of " + ", ".join(choices)
