"""Packages on demand keep every promise of the sandbox (run on bubblewrap and on Docker):

- after an install the kernel still has only ``lo`` and no route: nothing opened a network;
- the session's layer is read-only inside the kernel and comes AFTER the kernel's own packages
  on sys.path (it can add modules, never shadow the kernel's);
- one session's packages are not in another's kernel, and ``%pip`` installs only into the
  session whose channel asked (a request names no session);
- nothing of a package runs on the host (an sdist is refused, its setup.py never runs), and a
  wheel whose members climb out of the layer is refused before anything is written;
- no request pip could read as a file, a path, a URL or an option reaches pip, from any front
  door: the server runs in a directory full of buildable canaries, and none is ever built.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import REPO, Server, start_server
from tests.support.package_index import PackageIndex, index_env, plant_canaries, temporary_index

from .conftest import report


@pytest.fixture(scope="module")
def index() -> Iterator[PackageIndex]:
    with temporary_index() as idx:
        yield idx


@pytest.fixture(scope="module")
def srv(index: PackageIndex) -> Iterator[Server]:
    """The server runs in a directory of canaries (what pip would build, were a request read as a
    file of its working directory); its data dir and package cache get them too."""
    plant_canaries(index.tmp / "cwd", index.tmp / "HOST-RAN-BACKEND")
    s = start_server({**index_env(index, index.tmp), "KERNELMODE_SESSIONS__POOL_SIZE": "0",
                      "PYTHONPATH": str(REPO)}, cwd=index.tmp / "cwd")
    for d in (s.data_dir, s.data_dir / "package-cache"):
        plant_canaries(d, index.tmp / "HOST-RAN-BACKEND")
    yield s
    s.discard()


@pytest.fixture(scope="module")
def api(srv: Server) -> Iterator[httpx.Client]:
    with srv.client(timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def two(api: httpx.Client) -> Iterator[tuple[str, str]]:
    """Session a (kmtest-app installed over REST, kmtest-native by %pip) and session b (nothing)."""
    sids = [api.post("/v1/sessions", json={}).json()["session_id"] for _ in range(2)]
    r = api.post(f"/v1/sessions/{sids[0]}/packages", json={"packages": ["kmtest-app"]})
    assert r.status_code == 200, r.text
    out = execute(api, sids[0], "%pip install kmtest-native\nimport kmtest_app, kmtest_native")
    assert out["status"] == "ok", out
    yield sids[0], sids[1]
    for sid in sids:
        api.delete(f"/v1/sessions/{sid}")


def execute(api: httpx.Client, sid: str, code: str) -> dict:
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_seconds": 120})
    assert r.status_code == 200, r.text
    return r.json()


def probe(api: httpx.Client, sid: str, code: str) -> dict:
    return report(execute(api, sid, code))


def test_no_network_after_an_install(api, two) -> None:
    r = probe(api, two[0], """
import json, socket
print(json.dumps({"ifaces": [n for _, n in socket.if_nameindex()],
                  "routes": open('/proc/net/route').read().splitlines()[1:],
                  "routes6": [l for l in open('/proc/net/ipv6_route').read().splitlines() if not l.endswith(' lo')],
                  "imported": __import__('kmtest_app').answer()}))
""")
    assert r == {"ifaces": ["lo"], "routes": [], "routes6": [], "imported": 42}


def test_the_layer_is_read_only_and_after_the_kernels_packages(api, two) -> None:
    r = probe(api, two[0], """
import errno, json, os, sys, kmtest_app
layer = os.environ["KM_PACKAGES_DIR"]
site = [i for i, p in enumerate(sys.path) if p.endswith("site-packages")]
out = {"layer_last": sys.path.index(layer) > max(site), "writes": {}}
for target in (os.path.join(layer, "new.py"), kmtest_app.__file__, os.path.join(layer, "kmtest_app", "x.py")):
    try:
        with open(target, "a") as f:
            f.write("hacked = True\\n")
        out["writes"][target] = "written"
    except OSError as e:
        out["writes"][target] = errno.errorcode[e.errno]
try:
    os.rename(os.path.join(layer, "kmtest_app"), os.path.join(layer, "moved"))
    out["rename"] = "renamed"
except OSError as e:
    out["rename"] = errno.errorcode[e.errno]
print(json.dumps(out))
""")
    assert r["layer_last"] is True
    assert set(r["writes"].values()) <= {"EROFS", "EACCES", "EPERM"}, r
    assert r["rename"] in ("EROFS", "EACCES", "EPERM")


def test_another_session_sees_none_of_them(api, two, srv) -> None:
    layers = [str(p) for p in srv.data_dir.glob("packages/*")]
    assert layers  # the host side exists...
    r = probe(api, two[1], f"""
import importlib.util, json, os
layer = os.environ.get("KM_PACKAGES_DIR", "")
print(json.dumps({{"specs": [importlib.util.find_spec(m) is not None for m in ("kmtest_app", "kmtest_lib", "kmtest_native")],
                  "layer": sorted(os.listdir(layer)) if layer else None,
                  "host_paths": [os.path.exists(p) for p in {layers!r}]}}))
""")
    assert r["specs"] == [False, False, False]
    assert r["layer"] == []  # its own layer: empty
    assert not any(r["host_paths"])  # ...and no kernel sees the host's package directories


def test_nothing_from_a_package_runs_on_the_host(api, two, index, srv) -> None:
    r = api.post(f"/v1/sessions/{two[1]}/packages", json={"packages": ["kmtest-sdist-only"]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "no_wheel"
    assert not index.canary.exists()
    r = api.post(f"/v1/sessions/{two[1]}/packages", json={"packages": ["kmtest-traversal"]})
    assert r.status_code == 403, r.text
    assert r.json()["error"]["details"]["rule"] == "wheel_format"
    assert not list(srv.data_dir.rglob("kmtest_escaped.py"))
    assert not list(srv.data_dir.rglob("kmtest_traversal.py"))  # nothing of it was installed


def spellings(cwd: str) -> list[str]:
    """Requests pip could read as a file, a path, a URL or an option (each canary is real)."""
    return ["canary-1.0.tar.gz", "CANARY-1.0.TAR.GZ", "canary-1.0.tgz", "canary-1.0.zip", "Canary-1.0.Zip",
            "canary-1.0-py3-none-any.whl", "canary-1.0.tar.gz[extra]", "canary-1.0.tar.gz[a,b]==1.0",
            "canary-1.0.tar.gz; python_version > '3'", "canary-1.0.zip ; os_name == 'posix'",
            "./canary-1.0.tar.gz", f"{cwd}/canary-1.0.tar.gz", "canary/", "./canary", ".", "..", ".[extra]",
            "canary @ file:///" + cwd.lstrip("/") + "/canary-1.0.tar.gz", "canary@file:canary-1.0.tar.gz",
            f"file://{cwd}/canary-1.0.tar.gz", "file:canary-1.0.tar.gz", "file:.", "canary-1.0.tar.gz#egg=canary",
            "-e .", "-e", "--editable=.", "-r requirements.txt", "--index-url http://127.0.0.1:1/simple",
            "--find-links=.", "canary\\..\\canary-1.0.tar.gz", "~/canary-1.0.tar.gz"]


def refused(err: dict) -> bool:
    return err.get("code") == "package_refused" and err.get("details", {}).get("rule") == "index_names_only"


def test_no_request_is_read_as_a_file_and_no_backend_runs_on_the_host(api, srv, index) -> None:
    cwd = str(index.tmp / "cwd")
    sid = api.post("/v1/sessions", json={}).json()["session_id"]
    try:
        wrong = {}
        for text in spellings(cwd):
            r = api.post(f"/v1/sessions/{sid}/packages", json={"packages": [text]})
            if r.status_code != 403 or not refused(r.json()["error"]):
                wrong[text] = r.text[:200]
            r = api.post("/v1/sessions", json={"packages": ["kmtest-lib", text]})
            if r.status_code != 403 or not refused(r.json()["error"]):
                wrong["create: " + text] = r.text[:200]
        # From kernel code: %pip, and the preamble's request forged past %pip's own checks.
        out = report(execute(api, sid, f"""
import json, sys
kp = sys.modules['kernelmode_preamble']
errors = {{}}
for text in {spellings(cwd)!r}:
    try:
        kp._bridge.call(kp.PIP, {{"packages": [text]}})
        errors[text] = "installed"
    except Exception as e:
        errors[text] = str(e)
    if " " not in text and not text.startswith("-"):
        try:
            get_ipython().run_line_magic("pip", "install " + text)
            errors["%pip " + text] = "installed"
        except Exception as e:
            errors["%pip " + text] = str(e)
print(json.dumps(errors))
"""))
    finally:
        api.delete(f"/v1/sessions/{sid}")
    assert not index.tmp.joinpath("HOST-RAN-BACKEND").exists(), "a build backend ran on the host"
    assert not wrong, wrong
    assert len(out) > len(spellings(cwd))
    assert {k: v for k, v in out.items() if "package_refused" not in v or "index_names_only" not in v} == {}
