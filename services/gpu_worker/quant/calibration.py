"""The built-in calibration text of the calibrated quantizers (quant/awq.py, quant/gptq.py): docstrings of Python
standard library modules, available offline and deterministic for one Python version, cut into token windows."""
from __future__ import annotations

import importlib
import inspect

CALIBRATION_MODULES = ("os", "pickle", "zipfile", "tarfile", "configparser", "threading", "calendar", "shlex",
                       "pprint", "copy", "queue", "smtplib", "ftplib", "uuid", "gettext", "ipaddress", "mimetypes",
                       "base64", "glob", "fnmatch", "optparse", "socketserver", "codecs", "numbers", "sched")
"""Modules whose docstrings calibrate; bench/quant_quality.py scores other modules' docstrings."""
ON_LOAD_CALIBRATION_TOKENS = 1024
"""How many tokens a model quantized on load calibrates on (two windows of 512): the CPU loads the bundled
model with FP8 GPTQ in about a minute. `radixserve quantize` calibrates on as many, except --method awq."""
AWQ_WRITER_CALIBRATION_TOKENS = 2048
"""How many tokens `radixserve quantize --method awq` calibrates on by default: on the bundled model its INT4 grid
search meets issue 25's +10 % perplexity on both calibration texts from 2,048 tokens (+9.2 %, +8.8 %), on one of
them at 1,024 (+9.2 %, +10.5 %); docs/PERFORMANCE.md, the quantization quality section."""


def stdlib_docstrings(min_chars: int, modules: tuple[str, ...] = CALIBRATION_MODULES) -> str:
    """The docstrings of `modules` and of the classes and functions each defines (sorted by name), joined by blank
    lines, until at least min_chars characters."""
    parts: list[str] = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        members = [getattr(module, name) for name in sorted(vars(module)) if not name.startswith("_")]
        for obj in [module, *(m for m in members if inspect.getmodule(m) is module)]:
            doc = inspect.getdoc(obj)
            if doc and (obj is module or inspect.isclass(obj) or inspect.isfunction(obj)):
                parts.append(doc)
            if sum(map(len, parts)) >= min_chars:
                return "\n\n".join(parts)
    return "\n\n".join(parts)


def calibration_windows(tokenizer, num_tokens: int = ON_LOAD_CALIBRATION_TOKENS, window: int = 512,
                        modules: tuple[str, ...] = CALIBRATION_MODULES) -> list[list[int]]:
    """The first num_tokens tokens of stdlib_docstrings(modules) cut into whole windows of `window` token ids."""
    ids = tokenizer(stdlib_docstrings(num_tokens * 8, modules), add_special_tokens=False)["input_ids"][:num_tokens]
    return [ids[i: i + window] for i in range(0, len(ids) - window + 1, window)]


def on_load_calibration(tokenizer) -> list[list[int]] | None:
    """The windows a model quantized on load calibrates on (quant/apply.py quantize_linears_), or None where the
    model has no tokenizer (random weights): then it is rounded to nearest."""
    return None if tokenizer is None else calibration_windows(tokenizer)
