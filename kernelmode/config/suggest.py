"""Hints for an unknown config key: the nearest known key, or the section a misplaced key belongs in."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel

from .sections import Settings


def _section_model(path: tuple[str, ...]) -> type[BaseModel] | None:
    """The settings model at ``path`` (list items skipped), or None when it is not a model."""
    model: type[BaseModel] = Settings
    for part in path:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        inner = _model_in(field.annotation)
        if inner is None:
            return None
        model = inner
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _homes(key: str) -> list[str]:
    """Every dotted path where a key named ``key`` is valid (e.g. limits -> sandbox.limits)."""
    out: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if name == key:
                out.append(prefix + name)
            inner = _model_in(field.annotation)
            if inner is not None and len(prefix.split(".")) < 4:
                walk(inner, f"{prefix}{name}.")

    walk(Settings, "")
    return out


def unknown_key_hint(loc: tuple[str, ...]) -> str:
    """Text after "unknown key" for the key at ``loc``: what was probably meant."""
    parent, key = loc[:-1], loc[-1]
    model = _section_model(parent)
    if model is not None:
        near = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
        if near:
            return f" (did you mean {'.'.join((*parent, near[0]))!r}?)"
    homes = [h for h in _homes(key) if h != ".".join(loc)]
    if homes:
        return f" ({key!r} belongs under {' or '.join(repr(h.rsplit('.', 1)[0]) for h in homes[:3])}: " \
               f"move it to {homes[0]!r})"
    if model is not None:
        return f" (known keys here: {', '.join(sorted(model.model_fields))})"
    return ""
