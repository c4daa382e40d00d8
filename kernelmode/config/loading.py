"""Loading settings: a YAML file, ``${VAR}`` interpolation, ``KERNELMODE_*`` overrides.

An unknown or mistyped key is an error that names it, its line in the YAML file, and the nearest
known key (or the section where a misplaced key belongs).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError as PydanticValidationError

from ..errors import ConfigError
from .sections import ENV_PREFIX, Settings
from .suggest import unknown_key_hint

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _interpolate(value: Any, environ: dict[str, str]) -> Any:
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in environ:
                raise ConfigError(f"${{{name}}} is used in the config but not set in the environment")
            return environ[name]

        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {k: _interpolate(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, environ) for v in value]
    return value


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map each key path of a YAML mapping to its 1-based line, to point at bad keys."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = (*path, str(k.value))
                lines[key] = k.start_mark.line + 1
                walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, (*path, str(i)))

    root = yaml.compose(text)
    if root is not None:
        walk(root, ())
    return lines


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        # YAML parsing gives ints, floats and booleans their types ("10" -> 10).
        node[path[-1]] = yaml.safe_load(value) if value else value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def load_settings(
    path: str | Path | None = None, environ: dict[str, str] | None = None
) -> Settings:
    """Read settings from an optional YAML file and the environment; raise ConfigError."""
    environ = dict(os.environ if environ is None else environ)
    raw: dict[str, Any] = {}
    lines: dict[tuple[str, ...], int] = {}
    source = "environment"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
        try:
            loaded = yaml.safe_load(text)
            lines = _key_lines(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        raw = _interpolate(loaded, environ)
    raw = _merge(raw, _env_overrides(environ))
    if environ.get("KERNELMODE_TOKEN"):
        raw = _merge(raw, {"server": {"token": environ["KERNELMODE_TOKEN"]}})
    try:
        return Settings.model_validate(raw)
    except PydanticValidationError as e:
        problems = []
        for err in e.errors():
            key = tuple(str(p) for p in err["loc"])
            where = f" (line {lines[key]})" if key in lines else ""
            problem = ("unknown key" + unknown_key_hint(key) if err["type"] == "extra_forbidden"
                       else err["msg"])
            # A check across sections (loc ()) names its keys itself.
            problems.append(f"{'.'.join(key)}{where}: {problem}" if key else problem)
        raise ConfigError(f"{source}: " + "; ".join(problems)) from e
