"""Config loading: a service's frozen dataclass filled from CLI flags, then RADIXSERVE_* env vars, then defaults."""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
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
                            default=None, help=help_text)
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
