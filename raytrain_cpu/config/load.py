"""Building a config: plain dicts (a YAML file, dotted command-line overrides, what crossed the Ray
boundary) checked key by key against the dataclasses' annotated types, unknown keys refused."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from raytrain_cpu.config.checks import ConfigError


def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks one leaf value against its annotated type; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:  # a choice: read as its values' type; the section's check names the choices
        return _coerce(value, type(typing.get_args(tp)[0]), key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):  # YAML 1.1 reads 1e9 (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}.")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}.")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str) and item_tp is str:  # key=q_proj,v_proj on the command line
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            example = "[q_proj, v_proj]" if item_tp is str else "[0.9, 0.95]"
            raise ConfigError(f"{key}: expected a list like {example}, got {value!r}.")
        if dataclasses.is_dataclass(item_tp):  # data.mix: a list of sections
            return [build(item_tp, _section(v, f"{key}[{i}]"), f"{key}[{i}].") for i, v in enumerate(value)]
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping like {{name: 1}}, got {value!r}.")
        _, val_tp = typing.get_args(tp)
        return {str(k): _coerce(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    return value


def _section(value: Any, key: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    raise ConfigError(f"{key}: expected a section (mapping), got {value!r}.")


def build(cls: type, d: dict[str, Any] | None, prefix: str) -> Any:
    d = dict(d or {})
    hints = type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        where = prefix.rstrip(".") or "the top level"
        close = difflib.get_close_matches(unknown[0], names, n=1)
        guess = f"did you mean {prefix}{close[0]}? " if close else ""
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key in {where}; {guess}valid keys are {', '.join(names)}. "
            "Run `python -m raytrain_cpu.main --help` to list every option."
        )
    kwargs = {}
    for name in names:
        if name not in d:
            continue
        tp, key = hints[name], f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, _section(d[name], key), prefix=f"{key}.")
        else:
            kwargs[name] = _coerce(d[name], tp, key)
    return cls(**kwargs)


def set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = d
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {p} is a value, not a section.")
        node = nxt
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'train.lr=1e-3' -> ('train.lr', 0.001); values are read as YAML scalars/lists."""
    if "=" not in text or text.startswith("="):
        raise ConfigError(f"{text!r}: overrides look like section.key=value, e.g. train.max_steps=20.")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot read value {raw!r} ({e.__class__.__name__}).") from None
    return key.strip(), "" if value is None else value


def raw_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> dict[str, Any]:
    """The YAML file's sections with the overrides set over them, not yet checked. Raises ConfigError."""
    raw: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            what = "is a directory" if p.is_dir() else "does not exist"
            raise ConfigError(f"--config: {str(path)!r} {what}; pass a YAML file such as configs/local.yaml.")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config: {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--config: {path} must hold a mapping of sections (model:, data:, train:, ...).")
    given = [parse_override(item) for item in overrides]
    _choose_run_length(raw, {key: value for key, value in given}, path)
    for key, value in given:
        set_dotted(raw, key, value)
    return raw


def _choose_run_length(raw: dict[str, Any], overrides: dict[str, Any], path: Any) -> None:
    """train.max_steps or train.epochs (> 0): one of them says how long the run is. The file
    and the command line may each choose one; the command line's replaces the file's."""

    def chosen(train: dict[str, Any]) -> set[str]:  # epochs=0 chooses nothing: it leaves max_steps to say
        return {"max_steps"} & train.keys() | ({"epochs"} if train.get("epochs") not in (None, 0, 0.0) else set())

    cli = chosen({k.removeprefix("train."): v for k, v in overrides.items() if k.startswith("train.")})
    if len(cli) == 2:
        raise ConfigError(
            "train.max_steps and train.epochs: the command line sets both; keep one (train.epochs derives "
            "the steps from the packed data)."
        )
    train = raw.get("train")
    if not isinstance(train, dict):
        return
    if cli:  # the command line's choice of length replaces the file's
        train.pop("epochs" if cli == {"max_steps"} else "max_steps", None)
    elif len(chosen(train)) == 2:
        raise ConfigError(
            f"train.max_steps and train.epochs: --config {path} sets both; keep one (train.epochs derives the "
            "steps from the packed data), or choose on the command line, which replaces the file's choice."
        )
