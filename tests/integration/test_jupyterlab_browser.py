"""End to end in a real browser: JupyterLab started with ``--gateway-url`` on a live
``kernelmode serve``, driven by headless Debian Chromium through Playwright. The person opens a
notebook, picks the agent's session in JupyterLab's Select Kernel dialog, runs ``x + 1`` and sees the agent's ``x`` (41) plus one.
A screenshot of the result is kept under test-artifacts/ (gitignored; its path is printed)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelmode.api.jupyter_api import kernel_id_of
from tests.conftest import REPO, Server, start_server
from tests.support.jupyter_server import ATTACHING, JUPYTER_TOKEN, start_jupyter_server

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "test-artifacts"

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists() or importlib.util.find_spec("playwright") is None
    or importlib.util.find_spec("jupyterlab") is None,
    reason="needs Debian's chromium (scripts/install-system-deps.sh) and the test extra's "
           "jupyterlab + playwright")


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = start_server({"KERNELMODE_SESSIONS__POOL_SIZE": "1"})
    yield s
    s.discard()


def test_jupyterlab_runs_a_cell_in_the_agents_session(srv: Server) -> None:
    from playwright.sync_api import sync_playwright

    with srv.client() as agent:
        sid = agent.post("/v1/sessions", json={"session_id": "agent1-lab"}).json()["session_id"]
        assert agent.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 41"}).json()["status"] == "ok"
        proc, lab_url, root = start_jupyter_server(srv.url, srv.token, [ATTACHING], module="jupyterlab")
        try:
            # A notebook with no kernel yet: JupyterLab asks which kernel to use on opening it
            notebook = {"cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {},
                                   "outputs": [], "source": "x + 1"}],
                        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
            (root / "agent.ipynb").write_text(json.dumps(notebook))
            kid = kernel_id_of(sid)
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "jupyterlab-agent-session.png"
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
                try:
                    page = browser.new_page(viewport={"width": 1280, "height": 800})
                    page.goto(f"{lab_url}/lab/tree/agent.ipynb?token={JUPYTER_TOKEN}", timeout=120_000)
                    # The Select Kernel dialog lists the agent's session under "Connect to
                    # Existing Kernel" (AttachingKernelManager): pick it by its kernel id
                    select = page.locator(".jp-Dialog select").first
                    select.wait_for(timeout=120_000)
                    option = select.locator(f"option[value*='{kid}']").first
                    value = option.get_attribute("value", timeout=120_000)
                    # named after the session and its tenant, not the kernelspec
                    assert option.inner_text().startswith(f"{sid} · admin ("), option.inner_text()
                    select.select_option(value=value)
                    page.locator(".jp-Dialog .jp-mod-accept").first.click()
                    editor = page.locator(".jp-Notebook .jp-Cell .jp-InputArea-editor").first
                    editor.wait_for(timeout=120_000)
                    # The kernel is connected (its status in the toolbar says Idle) before running
                    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(
                        timeout=120_000)
                    editor.click()
                    page.keyboard.press("Shift+Enter")
                    output = page.locator(".jp-OutputArea-output", has_text="42").first
                    output.wait_for(timeout=120_000)
                    assert output.inner_text().strip() == "42"
                    page.screenshot(path=str(shot), full_page=True)
                finally:
                    browser.close()
            print(f"\nJupyterLab screenshot: {shot}")
            assert shot.stat().st_size > 0
            # The person's cell is in the agent's session history
            nb = agent.get(f"/v1/sessions/{sid}/notebook").json()
            assert "x + 1" in ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
        finally:
            proc.terminate()
            proc.wait(60)
            shutil.rmtree(root.parent, ignore_errors=True)
            # JupyterLab has exited (AttachingKernelManager stops only kernels it started, and
            # kernelmode only detaches an agent's session anyway): the agent's session stays
            assert agent.get(f"/v1/sessions/{sid}").json()["status"] != "lost"
            agent.delete(f"/v1/sessions/{sid}")
