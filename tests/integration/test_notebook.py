"""Notebook export: a session's runs as an .ipynb that nbformat validates, in order, with images
and errors, also after the session is closed (the notebook is kept with its artifacts)."""

from __future__ import annotations

import base64

import httpx
import nbformat

from tests.conftest import Server

PLOT = ("import matplotlib.pyplot as plt\nprint('before')\nplt.plot([1, 2, 3])\nplt.show()\n"
        "print('after')\n'done'")


def notebook(api: httpx.Client, sid: str) -> nbformat.NotebookNode:
    r = api.get(f"/v1/sessions/{sid}/notebook")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-ipynb+json"
    assert f"{sid}.ipynb" in r.headers["content-disposition"]
    nb = nbformat.reads(r.text, as_version=4)
    nbformat.validate(nb)  # schema-valid: opens cleanly in JupyterLab
    return nb


def test_export_matches_the_runs(api: httpx.Client, session_factory, run) -> None:
    sid = session_factory()
    run(sid, "x = 20")
    run(sid, PLOT)
    run(sid, "1/0")
    run(sid, "import sys; print('err', file=sys.stderr); x * 2")
    nb = notebook(api, sid)
    head, *cells = nb.cells
    assert head.cell_type == "markdown" and sid in head.source
    assert [c.source for c in cells] == ["x = 20", PLOT, "1/0", "import sys; print('err', file=sys.stderr); x * 2"]
    counts = [c.execution_count for c in cells]
    assert counts == sorted(counts) and None not in counts
    # Outputs in the order they came: stream, the figure, stream, the result.
    kinds = [(o.output_type, o.get("name")) for o in cells[1].outputs]
    assert kinds == [("stream", "stdout"), ("display_data", None), ("stream", "stdout"), ("execute_result", None)]
    png = base64.b64decode(cells[1].outputs[1].data["image/png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"  # the image survives
    assert cells[1].outputs[3].data["text/plain"] == "'done'"
    err = cells[2].outputs[-1]
    assert err.output_type == "error" and err.ename == "ZeroDivisionError"
    assert any("1/0" in line for line in err.traceback)
    assert cells[2].metadata["kernelmode"]["status"] == "error"
    assert [(o.output_type, o.get("name")) for o in cells[3].outputs] == [("stream", "stderr"), ("execute_result", None)]


def test_a_timeout_and_a_dead_kernel_show_as_errors(api: httpx.Client, session_factory, run) -> None:
    sid = session_factory()
    assert run(sid, "import time; time.sleep(5)", timeout_seconds=1)["status"] == "timeout"
    assert run(sid, "import os; os._exit(3)")["status"] == "kernel_died"
    cells = notebook(api, sid).cells[1:]
    assert cells[0].outputs[-1].ename in ("KeyboardInterrupt", "Timeout")
    assert cells[1].outputs[-1].ename == "KernelDied" and "exit code 3" in cells[1].outputs[-1].evalue


def test_closing_keeps_the_notebook_with_the_artifacts(api: httpx.Client, server: Server, run) -> None:
    sid = api.post("/v1/sessions", json={}).json()["session_id"]
    run(sid, "y = 'kept'\ny")
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    arts = {a["name"]: a for a in api.get(f"/v1/sessions/{sid}/artifacts").json()["artifacts"]}
    kept = httpx.get(arts["notebook.ipynb"]["download_url"])  # signed link, no token
    assert kept.status_code == 200
    nb = nbformat.reads(kept.text, as_version=4)
    nbformat.validate(nb)
    assert nb.cells[1].source == "y = 'kept'\ny"
    # The export still works from the stored runs.
    assert notebook(api, sid).cells[1].outputs[0].data["text/plain"] == "'kept'"


def test_unknown_session_and_auth(api: httpx.Client, server: Server) -> None:
    r = api.get("/v1/sessions/nope/notebook")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    with server.client(token="wrong") as bad:
        assert bad.get("/v1/sessions/nope/notebook").status_code == 401
