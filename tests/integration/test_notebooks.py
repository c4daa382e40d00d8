"""The example notebooks (notebooks/) run top to bottom against a real server, so they never rot."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO, Server

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELMODE_URL", server.url)
    monkeypatch.setenv("KERNELMODE_TOKEN", server.token)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == []


def test_notebooks_are_generated_from_make_notebooks() -> None:
    """notebooks/*.ipynb are what make_notebooks.py writes (edit the script, not the JSON)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_notebooks", REPO / "notebooks" / "make_notebooks.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("quickstart", "debugging"):
        fresh = getattr(mod, name)()
        stored = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
        assert [c.source for c in stored.cells] == [c.source for c in fresh.cells]
    assert len(NOTEBOOKS) == 2 and os.path.exists(REPO / "notebooks" / "quickstart.ipynb")
