"""The documentation site stays whole: it builds strictly, its generated pages are current, and
the README stays short with links that resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_generated_pages_are_current() -> None:
    """docs/reference/settings.md and docs/performance.md are what scripts/gen_docs.py makes of
    the settings models and bench/RESULTS.md (a new setting or a new benchmark record must be
    regenerated, not hand-edited)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_every_setting_has_a_description() -> None:
    from pydantic import BaseModel

    from kernelmode.config import Settings
    from kernelmode.config.docs import field_descriptions

    missing: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        described = field_descriptions(model)
        for name, field in model.model_fields.items():
            if name not in described:
                missing.append(prefix + name)
            for arg in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    walk(arg, f"{prefix}{name}.")

    walk(Settings, "")
    assert not missing, f"settings without a description (the generated reference needs one): {missing}"


def test_site_builds_strictly(tmp_path: Path) -> None:
    """mkdocs --strict: a broken link or anchor, or a page missing from the nav, fails."""
    pytest.importorskip("mkdocs", reason="the docs extra (make setup installs it)")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "settings" / "index.html").is_file()


def test_readme_is_short_and_its_links_resolve() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md is over 250 lines: move the detail to docs/"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (REPO / target).exists(), f"README links to {target}, which does not exist"
