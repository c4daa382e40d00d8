"""docs/configuration.md and kernelmode.example.yaml stay true to kernelmode/config/sections.py.

Every field of every settings model (found by walking the pydantic models, so a new setting is
caught) must be documented in its section of the reference and set in the example; the example
must load, pass `kernelmode config check`, and state the real defaults; bad keys and unset
``${VAR}``s give the errors the reference shows.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from kernelmode.config import Settings, load_settings
from kernelmode.errors import ConfigError
from kernelmode.models import LimitCeilings, Limits

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "kernelmode.example.yaml"
DOCS = REPO / "docs" / "configuration.md"

# The ${VAR}s the example interpolates (secrets of its two MCP servers, a tenant's token).
EXAMPLE_ENV = {"GITHUB_TOKEN": "ghp_example_not_a_token", "SEARCH_TOKEN": "search-example-token",
               "TEAM_A_TOKEN": "team-a-example-token-0123"}

# Settings the example shows only as a commented-out line (`# key: value`), and why.
COMMENTED_OUT = {
    "sandbox.kernel_python": "its default is an absolute path inside the checkout, which an "
    "example cannot spell; a relative path breaks the sandbox (bwrap cannot execvp it)",
    "gateway.config_dir": "its default is an absolute path inside the checkout; a relative path "
    "is not found by the gateway, which runs in DATA_DIR/gateway",
}

# Scalar settings the example sets to something other than their default, and why. The example
# states every default as it is, so there are none; add an entry here (with its reason) to
# change one deliberately.
DELIBERATELY_CHANGED: dict[str, str] = {}

# Defaults that depend on where kernelmode is installed: the reference writes them as
# <checkout>/..., so they are not compared with the code's value.
MACHINE_DEFAULTS = {"sandbox.kernel_python", "gateway.config_dir"}


# -- walking the settings models -------------------------------------------------------------------
def _model_types(annotation: Any) -> tuple[list[type[BaseModel]], bool]:
    """The BaseModel classes in an annotation, and whether they are items of a list."""
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    if origin in (list, tuple, set, frozenset):
        found = [m for a in typing.get_args(annotation) for m in _model_types(a)[0]]
        return found, True
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        found, in_list = [], False
        for a in typing.get_args(annotation):
            ms, lst = _model_types(a)
            found += ms
            in_list = in_list or lst
        return found, in_list
    return [], False


def settings_models() -> list[tuple[str, type[BaseModel], bool]]:
    """(dotted path, model, under a list) of every model nested in Settings, recursively."""
    out: list[tuple[str, type[BaseModel], bool]] = []

    def walk(model: type[BaseModel], path: str, under_list: bool) -> None:
        for name, field in model.model_fields.items():
            models, in_list = _model_types(field.annotation)
            for sub in models:
                sub_path = f"{path}.{name}" if path else name
                out.append((sub_path, sub, under_list or in_list))
                walk(sub, sub_path, under_list or in_list)

    walk(Settings, "", False)
    return out


def scalar_fields(model: type[BaseModel]) -> list[str]:
    return [n for n, f in model.model_fields.items() if not _model_types(f.annotation)[0]]


MODELS = settings_models()


def test_the_walk_finds_every_section_and_limits() -> None:
    paths = {p: m for p, m, _ in MODELS}
    assert set(Settings.model_fields) <= set(paths), "every section is a model"
    assert paths["sandbox.limits"] is Limits
    assert paths["sandbox.max_limits"] is LimitCeilings
    assert {p for p, _, under_list in MODELS if under_list} == {
        "tools", "mcp_servers", "server.tenants", "server.tenants.max_limits", "server.tenants.egress",
        "egress.secrets"}


# -- the example file --------------------------------------------------------------------------------
def _example_raw() -> dict[str, Any]:
    raw = yaml.safe_load(EXAMPLE.read_text())
    assert isinstance(raw, dict)
    return raw


def _mappings_at(raw: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """The YAML mappings at a dotted path; list items are flattened (tools -> each tool)."""
    nodes: list[Any] = [raw]
    for part in path.split("."):
        nxt: list[Any] = []
        for node in nodes:
            value = node.get(part) if isinstance(node, dict) else None
            nxt.extend(value if isinstance(value, list) else [value] if value is not None else [])
        nodes = nxt
    assert all(isinstance(n, dict) for n in nodes), path
    return nodes


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without KERNELMODE_* overrides (they would change the result)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELMODE_")}
    env.update(extra)
    return env


def _config_check(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kernelmode.cli", "config", "check", str(path)],
        capture_output=True, text=True, env=env, cwd=str(REPO), timeout=60,
    )


def test_example_interpolates_exactly_the_variables_the_tests_set() -> None:
    used = {m for s in _strings(_example_raw()) for m in re.findall(r"\$\{(\w+)\}", s)}
    assert used == set(EXAMPLE_ENV)


async def test_example_loads_and_its_tools_are_real(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(EXAMPLE, environ=dict(EXAMPLE_ENV))
    assert settings.mcp_servers[0].env["GITHUB_PERSONAL_ACCESS_TOKEN"] == EXAMPLE_ENV["GITHUB_TOKEN"]
    assert settings.mcp_servers[1].headers["Authorization"] == f"Bearer {EXAMPLE_ENV['SEARCH_TOKEN']}"
    assert {s.command is None for s in settings.mcp_servers} == {True, False}, "one stdio, one HTTP"
    # What `serve` does with them before connecting: import each tool, check the names. Building
    # the registry connects to nothing (upstream servers are only started by serve).
    monkeypatch.syspath_prepend(str(REPO))
    from kernelmode.tools.python_tool import load_callable
    from kernelmode.tools.registry import ToolRegistry

    for tool in settings.tools:
        assert callable(load_callable(tool.function))
    registry = ToolRegistry()
    registry.add_from_settings(settings.tools, settings.mcp_servers)
    assert {t.info.name for t in registry.all()} == {t.name for t in settings.tools}
    assert registry.namespaces == {s.name for s in settings.mcp_servers}


def test_config_check_accepts_the_example() -> None:
    settings = load_settings(EXAMPLE, environ=dict(EXAMPLE_ENV))
    proc = _config_check(EXAMPLE, _clean_env(**EXAMPLE_ENV))
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert "token" not in printed["server"]
    expected = json.loads(settings.model_dump_json(exclude={"server": {"token"}}))
    # Secrets filled in from the environment are masked in the printout.
    for server in expected["mcp_servers"]:
        server["env"] = {k: "***" for k in server["env"]}
        server["headers"] = {k: "***" for k in server["headers"]}
    if expected["artifacts"]["secret_key"]:
        expected["artifacts"]["secret_key"] = "***"
    for tenant in expected["server"]["tenants"]:
        tenant["token"] = "***"
    for secret in expected["egress"]["secrets"]:
        secret["value"] = "***"
    assert printed == expected
    assert all(value not in proc.stdout for value in EXAMPLE_ENV.values())


# -- every setting is documented and in the example -------------------------------------------------
def _doc_sections() -> dict[str, str]:
    """Text under each '### `path`' heading of the reference, up to the next heading."""
    sections: dict[str, str] = {}
    current: str | None = None
    for line in DOCS.read_text().splitlines():
        if line.startswith("#"):
            m = re.fullmatch(r"### `([\w.]+)`", line.strip())
            current = m.group(1) if m else None
            if current is not None:
                sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return sections


@pytest.mark.parametrize("path", [p for p, _, _ in MODELS])
def test_every_field_is_in_the_docs_and_the_example(path: str) -> None:
    model = {p: m for p, m, _ in MODELS}[path]
    sections = _doc_sections()
    assert path in sections, f"docs/configuration.md has no '### `{path}`' section"
    text = EXAMPLE.read_text()
    keys = {k for mapping in _mappings_at(_example_raw(), path) for k in mapping}
    assert keys, f"kernelmode.example.yaml has no {path}"
    for name in model.model_fields:
        assert f"`{name}`" in sections[path], f"{path}.{name} is not documented in its section"
        if f"{path}.{name}" in COMMENTED_OUT:
            assert name not in keys
            assert re.search(rf"^\s*#\s*{name}:", text, re.M), f"{path}.{name}: no commented line"
        else:
            assert name in keys, f"kernelmode.example.yaml does not set {path}.{name}"


def test_commented_out_entries_are_real_settings() -> None:
    for dotted in COMMENTED_OUT:
        path, _, name = dotted.rpartition(".")
        assert name in {p: m for p, m, _ in MODELS}[path].model_fields


def _doc_default(section: str, name: str) -> str:
    """The default column of the option's row in the reference's table."""
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] == f"`{name}`":
            return cells[2]
    raise AssertionError(f"no table row for `{name}`")


@pytest.mark.parametrize("path", [p for p, _, under_list in MODELS if not under_list])
def test_documented_defaults_are_the_real_ones(path: str) -> None:
    model = {p: m for p, m, _ in MODELS}[path]
    section = _doc_sections()[path]
    defaults = model()
    for name in scalar_fields(model):
        if f"{path}.{name}" in MACHINE_DEFAULTS:
            continue
        cell = _doc_default(section, name)
        m = re.match(r"`([^`]*)`", cell)
        assert m, f"{path}.{name}: default column {cell!r} has no `value`"
        real = getattr(defaults, name)
        stated = yaml.safe_load(m.group(1))
        if isinstance(real, Path):
            stated = Path(stated)
        assert stated == real, f"{path}.{name}: the docs say {stated!r}, the code {real!r}"


# -- the example's values are the defaults ----------------------------------------------------------
def test_example_values_are_the_defaults() -> None:
    """Load the example alone (no KERNELMODE_* variables) and compare every scalar setting of
    every section with Settings(); list items (tools, mcp_servers) have no defaults to compare."""
    loaded = load_settings(EXAMPLE, environ=dict(EXAMPLE_ENV))
    defaults = Settings()
    raw = _example_raw()
    compared, changed = [], {}
    for path, model, under_list in MODELS:
        if under_list:
            continue
        (mapping,) = _mappings_at(raw, path)
        got, want = loaded, defaults
        for part in path.split("."):
            got, want = getattr(got, part), getattr(want, part)
        for name in scalar_fields(model):
            dotted = f"{path}.{name}"
            if dotted in COMMENTED_OUT:
                continue
            assert name in mapping, f"the example does not set {dotted}"
            compared.append(dotted)
            if getattr(got, name) != getattr(want, name):
                changed[dotted] = (getattr(got, name), getattr(want, name))
    assert set(changed) == set(DELIBERATELY_CHANGED), (
        f"the example differs from the defaults in {changed}; list deliberate changes "
        "in DELIBERATELY_CHANGED with a reason")
    every = {f"{p}.{n}" for p, m, u in MODELS if not u for n in scalar_fields(m)}
    assert set(compared) == every - set(COMMENTED_OUT)


# -- errors ---------------------------------------------------------------------------------------------
def _with_line_after(anchor: str, new_line: str) -> tuple[str, int]:
    """The example's text with ``new_line`` inserted after the line that starts with ``anchor``,
    and the 1-based number of the inserted line."""
    lines = EXAMPLE.read_text().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith(anchor))
    lines.insert(index + 1, new_line + "\n")
    return "".join(lines), index + 2


@pytest.mark.parametrize(("anchor", "bad", "key"), [
    ("  max_sessions:", "  max_sesions: 10", "sessions.max_sesions"),
    ("    memory_mb:", "    memory_mib: 2048", "sandbox.limits.memory_mib"),
    ("    function: \"examples.host_tools_example:word_count\"", "    fn: x", "tools.0.fn"),
])
def test_a_bad_key_names_the_key_and_its_line(tmp_path: Path, anchor: str, bad: str, key: str) -> None:
    text, line = _with_line_after(anchor, bad)
    path = tmp_path / "kernelmode.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings(path, environ=dict(EXAMPLE_ENV))
    assert f"{key} (line {line}): unknown key" in e.value.message
    proc = _config_check(path, _clean_env(**EXAMPLE_ENV))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"{key} (line {line}): unknown key" in proc.stderr


@pytest.mark.parametrize("missing", sorted(EXAMPLE_ENV))
def test_an_unset_variable_is_a_clear_error(missing: str) -> None:
    env = {k: v for k, v in EXAMPLE_ENV.items() if k != missing}
    expected = f"${{{missing}}} is used in the config but not set in the environment"
    with pytest.raises(ConfigError) as e:
        load_settings(EXAMPLE, environ=env)
    assert e.value.message == expected
    proc_env = _clean_env(**env)
    proc_env.pop(missing, None)
    proc = _config_check(EXAMPLE, proc_env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"kernelmode: {expected}"


def test_descriptions_come_from_the_source_not_from_the_start() -> None:
    """The reference's descriptions are read from the source on demand (config/docs.py): a start
    builds the settings without parsing their modules (pydantic's use_attribute_docstrings did,
    ~40 ms of every start), and a field keeps its description= over its attribute docstring."""
    from pydantic import Field

    from kernelmode.config.docs import field_descriptions

    assert not [path for path, model, _ in MODELS if model.model_config.get("use_attribute_docstrings")]

    class Base(BaseModel):
        a: int = 0
        """A, from the base."""

    class Child(Base):
        b: int = Field(0, description="B, given.")
        """B, not this."""
        c: int = 0
        """C's first line.

            Its second."""
        d: int = 0

    assert field_descriptions(Child) == {"a": "A, from the base.", "b": "B, given.", "c": "C's first line.\n\nIts second."}
    assert field_descriptions(Settings)["server"]  # a section's own description
