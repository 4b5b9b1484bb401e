"""`--help`'s option list: every leaf option's dotted key, declared default and docstring."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from raytrain_cpu.config.load import type_hints
from raytrain_cpu.config.schema import Config


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal right under each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        is_field = isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
        if (
            is_field
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        ):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def describe_options(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, meaning) for every leaf option: the default as declared ('auto'), not
    what validation resolves it to on this machine ('bundled')."""
    docs = _field_docs(cls)
    hints = type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe_options(hints[f.name], f"{prefix}{f.name}.")
        else:
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((f"{prefix}{f.name}", repr(value), docs.get(f.name, "")))
    return rows


def options_help() -> str:
    lines = ["options (set in the YAML file or as key=value after it):"]
    for key, default, doc in describe_options():
        lines.append(f"  {key} (default {default})")
        lines.extend("      " + ln for ln in textwrap.wrap(doc, 84))
    return "\n".join(lines)
