"""Workspace files and artifacts through the REST API with the local store (real kernels)."""

from __future__ import annotations

import time
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import httpx


def _up(api, sid: str, path: str, data: bytes, **params) -> httpx.Response:
    return api.put(f"/v1/sessions/{sid}/files/{path}", content=data, params=params)


def test_upload_analyse_and_download_artifacts(api, session_factory, run):
    sid = session_factory()
    r = _up(api, sid, "in/sales.csv", b"region,amount\nnorth,10\nsouth,32\n")
    assert r.status_code == 201 and r.json() == {"path": "/mnt/data/in/sales.csv", "size_bytes": 32}
    res = run(sid, "import pandas as pd, matplotlib.pyplot as plt\n"
                   "df = pd.read_csv('/mnt/data/in/sales.csv')\n"
                   "df.groupby('region').amount.sum().to_csv('totals.csv')\n"
                   "df.plot.bar(x='region', y='amount')\nplt.show()\n"
                   "int(df.amount.sum())")
    assert res["status"] == "ok" and res["result"] == "42", res
    arts = {a["path"]: a for a in res["artifacts"]}
    assert set(arts) == {"/mnt/data/totals.csv", "outputs/output-1.png"}  # the upload is an input
    png = httpx.get(arts["outputs/output-1.png"]["download_url"])  # no token needed
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.headers["content-type"] == "image/png"
    csv = httpx.get(arts["/mnt/data/totals.csv"]["download_url"])
    assert csv.text == "region,amount\nnorth,10\nsouth,32\n"
    import hashlib
    assert hashlib.sha256(csv.content).hexdigest() == arts["/mnt/data/totals.csv"]["sha256"]
    # Unchanged files are not harvested again; changed ones are.
    assert run(sid, "1")["artifacts"] == []
    again = run(sid, "open('totals.csv', 'a').write('east,1\\n')")
    assert [a["path"] for a in again["artifacts"]] == ["/mnt/data/totals.csv"]
    files = {f["path"]: f for f in api.get(f"/v1/sessions/{sid}/files").json()["files"]}
    assert files["/mnt/data/in/sales.csv"]["mime_type"] == "text/csv"
    assert files["/mnt/data/totals.csv"]["size_bytes"] == len(csv.content) + len("east,1\n")
    got = api.get(f"/v1/sessions/{sid}/files/in/sales.csv")
    assert got.status_code == 200 and got.content.startswith(b"region")
    assert got.headers["content-type"] == "text/csv"


def test_overwrite_rules(api, session_factory):
    sid = session_factory()
    assert _up(api, sid, "a.txt", b"1").status_code == 201
    r = _up(api, sid, "a.txt", b"2")
    assert r.status_code == 409 and r.json()["error"]["code"] == "file_exists"
    assert _up(api, sid, "a.txt", b"3", overwrite="true").status_code == 201
    assert api.get(f"/v1/sessions/{sid}/files/a.txt").content == b"3"


def test_failed_run_keeps_its_error_and_harvests_nothing(session_factory, run):
    sid = session_factory()
    r = run(sid, "open('x.txt', 'w').write('x')\nraise ValueError('nope')")
    assert r["status"] == "error" and r["error"]["ename"] == "ValueError" and r["artifacts"] == []


def test_path_attacks_from_the_api(api, session_factory):
    sid = session_factory()
    # (percent-encoded, so that the client sends them as they are)
    for bad in ["..%2Fetc%2Fpasswd", "a%2F..%2F..%2Fx", "%2e%2e/x", "%2e/x", "%00x", "a%5Cb", "a//b", "%2Fetc%2Fpasswd"]:
        r = api.put(f"/v1/sessions/{sid}/files/{bad}", content=b"x")
        assert r.status_code in (400, 404, 422), (bad, r.status_code, r.text)
        r = api.get(f"/v1/sessions/{sid}/files/{bad}")
        assert r.status_code in (400, 404, 422), (bad, r.status_code, r.text)


def test_links_made_by_kernel_code_are_never_followed(api, session_factory, run, server):
    sid = session_factory()
    res = run(sid, "import os\nos.symlink('/etc/passwd', 'pw')\nos.symlink('/', 'root')\n"
                   "open('real.txt', 'w').write('r')\nos.link('real.txt', 'hard.txt')")
    assert res["status"] == "ok", res
    # Neither the links nor the hard-linked file are served, listed or harvested.
    assert [a["path"] for a in res["artifacts"]] == []
    for path in ("pw", "root/etc/passwd", "hard.txt", "real.txt"):
        assert api.get(f"/v1/sessions/{sid}/files/{path}").status_code == 404, path
    assert api.get(f"/v1/sessions/{sid}/files").json()["files"] == []
    # Uploading over a planted link replaces the link; it never writes through it.
    run(sid, "import os\nos.symlink('/tmp/target', 'up.txt')")
    assert _up(api, sid, "up.txt", b"safe", overwrite="true").status_code == 201
    assert run(sid, "import os\n(os.path.islink('up.txt'), open('up.txt').read())")["result"] == "(False, 'safe')"
    # A planted directory link is refused as a parent.
    run(sid, "import os\nos.symlink('/tmp', 'dirlink')")
    assert _up(api, sid, "dirlink/x.txt", b"x").status_code in (400, 404, 409, 422)


def test_tampered_and_expired_links_are_403(session_factory, run):
    sid = session_factory()
    url = run(sid, "open('f.txt', 'w').write('data')")["artifacts"][0]["download_url"]
    assert httpx.get(url).text == "data"
    parts = urlsplit(url)
    q = {k: v[0] for k, v in parse_qs(parts.query).items()}
    tampered = dict(q, sig=q["sig"][:-1] + ("0" if q["sig"][-1] != "0" else "1"))
    expired = dict(q, expires=str(int(time.time()) - 1))
    other = urlunsplit(parts._replace(path=parts.path.replace("f.txt", "g.txt")))
    for u in (urlunsplit(parts._replace(query=urlencode(tampered))),
              urlunsplit(parts._replace(query=urlencode(expired))), other):
        r = httpx.get(u)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", u


def test_html_and_svg_are_attachments(session_factory, run):
    sid = session_factory()
    res = run(sid, "from IPython.display import HTML, display\nopen('p.html', 'w').write('<script>alert(1)</script>')\n"
                   "display(HTML('<b>x</b>'))")
    for a in res["artifacts"]:
        r = httpx.get(a["download_url"])
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["content-disposition"].startswith("attachment"), a
        assert r.headers["content-type"] == "text/html"


def test_artifacts_outlive_the_session(api, run):
    sid = api.post("/v1/sessions", json={}).json()["session_id"]
    run(sid, "open('keep.txt', 'w').write('kept')")
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    arts = api.get(f"/v1/sessions/{sid}/artifacts").json()["artifacts"]
    assert [a["path"] for a in arts] == ["/mnt/data/keep.txt", "notebook.ipynb"]  # + the kept notebook
    assert httpx.get(arts[0]["download_url"]).text == "kept"
    assert api.get("/v1/sessions/never-existed/artifacts").status_code == 404


def test_caps_on_artifacts_and_uploads(api, session_factory, run):
    sid = session_factory(limits={"disk_mb": 1})
    r = _up(api, sid, "big.bin", b"x" * (2 * 1024 * 1024))
    assert r.status_code == 413 and r.json()["error"]["code"] == "workspace_full"
    res = run(sid, "for i in range(60):\n    open(f'f{i:02d}.txt', 'w').write(str(i))")
    assert len(res["artifacts"]) == 50 and res["artifacts_truncated"] is True


def test_marketing_report_example_runs(server, tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "report.pdf"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "marketing_report.py"), str(out)],
        env={**os.environ, "KERNELMODE_URL": server.url, "KERNELMODE_TOKEN": server.token},
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "step 2: ok; artifacts: by_channel.png, monthly.png, output-1.png, output-2.png" in proc.stdout
    assert "step 1: ok; artifacts: -" in proc.stdout
    assert "best channel: search (roi 2.29)" in proc.stdout
    assert out.read_bytes().startswith(b"%PDF")


def test_upload_caps_are_clear_errors(api, session_factory, server):
    sid = session_factory()
    # Over the upload cap (100 MB default): refused from its Content-Length, before the body.
    import http.client
    import json
    from urllib.parse import urlsplit

    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.putrequest("PUT", f"/v1/sessions/{sid}/files/huge.bin")
    conn.putheader("Authorization", f"Bearer {server.token}")
    conn.putheader("Content-Length", str(200 * 1024 * 1024))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "payload_too_large"
    conn.close()
    # A streamed upload of several chunks lands whole.
    big = bytes(range(256)) * 8192  # 2 MiB
    assert api.put(f"/v1/sessions/{sid}/files/big.bin", content=iter([big[:1 << 20], big[1 << 20:]])).status_code == 201
    assert api.get(f"/v1/sessions/{sid}/files/big.bin").content == big
