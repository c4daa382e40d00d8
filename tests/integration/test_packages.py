"""Packages on demand, through every front door, on a real server with a real index on loopback
(tests/support/package_index.py): the host downloads wheels for the kernel's target, the session's kernel
imports them; refusals name their rule; the kernel's own packages are never replaced."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kernelmode.client import Client
from kernelmode.errors import NoWheel, PackageRefused
from tests.conftest import Server, start_server
from tests.support.package_index import PackageIndex, index_env, temporary_index


@pytest.fixture(scope="module")
def index() -> Iterator[PackageIndex]:
    with temporary_index() as idx:
        yield idx


@pytest.fixture(scope="module")
def pkg_server(index: PackageIndex) -> Iterator[Server]:
    srv = start_server({**index_env(index, index.tmp), "KERNELMODE_SESSIONS__POOL_SIZE": "1"})
    yield srv
    srv.discard()


@pytest.fixture()
def api(pkg_server: Server) -> Iterator[httpx.Client]:
    with pkg_server.client(timeout=300) as c:
        yield c


@pytest.fixture()
def new_session(api: httpx.Client) -> Iterator[object]:
    made: list[str] = []

    def make(**body: object) -> str:
        r = api.post("/v1/sessions", json=body)
        assert r.status_code == 201, r.text
        made.append(r.json()["session_id"])
        return made[-1]

    yield make
    for sid in made:
        api.delete(f"/v1/sessions/{sid}")


@pytest.fixture(scope="module")
def shared_sid(pkg_server: Server) -> Iterator[str]:
    """One session for the checks that install nothing."""
    with pkg_server.client() as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        yield sid
        c.delete(f"/v1/sessions/{sid}")


def run(api: httpx.Client, sid: str, code: str) -> dict:
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_seconds": 120})
    assert r.status_code == 200, r.text
    return r.json()


def install(api: httpx.Client, sid: str, *packages: str) -> httpx.Response:
    return api.post(f"/v1/sessions/{sid}/packages", json={"packages": list(packages)})


def names(refs: list[dict]) -> dict[str, str]:
    return {r["name"]: r["version"] for r in refs}


def test_a_package_with_its_dependency_installs_and_imports(api, new_session, index) -> None:
    sid = new_session()
    before = len(index.requests)
    r = install(api, sid, "kmtest-app==1.0")
    assert r.status_code == 200, r.text
    assert names(r.json()["installed"]) == {"kmtest-app": "1.0", "kmtest-lib": "1.0"}
    assert len(index.requests) > before  # the first install asked the index
    out = run(api, sid, "import kmtest_app, kmtest_lib, sys\nprint(kmtest_app.answer(), kmtest_lib.__file__)")
    assert out["status"] == "ok", out
    value, path = out["stdout"].split()
    assert value == "42"
    assert path.startswith("/opt/kernelmode/packages/") or "packages" in path

    again = install(api, sid, "kmtest-app")
    assert again.status_code == 200 and again.json()["installed"] == []
    assert names(again.json()["already"]) == {"kmtest-app": "1.0"}


def test_a_cached_install_needs_no_index_and_another_session_does_not_see_it(api, new_session, index) -> None:
    first, second = new_session(), new_session()
    assert install(api, first, "kmtest-app==1.0").status_code == 200
    asked = len(index.requests)
    # The packages of one session are not in another.
    out = run(api, second, "import importlib.util\nprint(importlib.util.find_spec('kmtest_app'))")
    assert out["stdout"].strip() == "None"
    r = install(api, second, "kmtest-app==1.0")
    assert r.status_code == 200, r.text
    assert names(r.json()["installed"]) == {"kmtest-app": "1.0", "kmtest-lib": "1.0"}
    assert len(index.requests) == asked  # from the cache: the index was not asked again
    assert run(api, second, "import kmtest_app; print(kmtest_app.answer())")["stdout"].strip() == "42"


def test_the_wheel_is_chosen_for_the_kernels_platform(api, new_session) -> None:
    sid = new_session()
    r = install(api, sid, "kmtest-native")
    assert r.status_code == 200, r.text
    assert run(api, sid, "import kmtest_native; print(kmtest_native.PLATFORM)")["stdout"].strip() == "manylinux"
    r = install(api, sid, "kmtest-maconly")
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "no_wheel"


def test_an_sdist_only_package_is_never_built(api, new_session, index) -> None:
    sid = new_session()
    r = install(api, sid, "kmtest-sdist-only")
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "no_wheel"
    assert "never builds" in err["message"]
    assert not index.canary.exists()  # its setup.py did not run on the host


@pytest.mark.parametrize(("package", "rule"), [
    ("kmtest-denied", "deny: kmtest-denied"),
    ("kmtest-usesevil", "deny: kmtest-evil*"),  # a denied dependency
])
def test_deny_rules_refuse_and_name_the_rule(api, new_session, package, rule) -> None:
    sid = new_session()
    r = install(api, sid, package)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "package_refused"
    assert err["details"]["rule"] == rule
    assert rule.split(": ")[1] in err["message"]
    out = run(api, sid, "import importlib.util\nprint(importlib.util.find_spec('kmtest_usesevil'), "
                        "importlib.util.find_spec('kmtest_evil'))")
    assert out["stdout"].strip() == "None None"


@pytest.mark.parametrize("package", ["tornado==6.1", "ipykernel<1", "kmtest-conflict"])
def test_the_kernels_own_packages_are_never_replaced(api, new_session, package) -> None:
    sid = new_session()
    before = run(api, sid, "import tornado, ipykernel; print(tornado.version, ipykernel.__version__)")["stdout"]
    r = install(api, sid, package)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "package_refused"
    assert r.json()["error"]["details"]["rule"] == "kernel_packages"
    # The kernel is untouched and still answers (ipykernel would break on another tornado).
    assert run(api, sid, "import tornado, ipykernel; print(tornado.version, ipykernel.__version__)")["stdout"] == before
    assert run(api, sid, "1 + 1")["result"] == "2"


def test_packages_survive_a_kernel_restart(api, new_session) -> None:
    sid = new_session()
    assert install(api, sid, "kmtest-app").status_code == 200
    assert api.post(f"/v1/sessions/{sid}/restart").status_code == 200
    out = run(api, sid, "import kmtest_app; print(kmtest_app.answer())")
    assert out["status"] == "ok" and out["stdout"].strip() == "42", out


def test_a_package_the_kernel_has_is_already_there(api, new_session) -> None:
    sid = new_session()
    version = run(api, sid, "import ipykernel; print(ipykernel.__version__)")["stdout"].strip()
    r = install(api, sid, "ipykernel")
    assert r.status_code == 200, r.text
    assert r.json() | {"duration_ms": 0} == {"installed": [], "already": [{"name": "ipykernel", "version": version}],
                                            "duration_ms": 0}


def test_the_download_cap_refuses_a_big_package(api, new_session) -> None:
    sid = new_session()
    r = install(api, sid, "kmtest-big")
    assert r.status_code == 403, r.text
    assert r.json()["error"]["details"]["rule"] == "max_download_mb"


@pytest.mark.parametrize("body", [
    {"packages": []}, {"packages": "kmtest-app"}, {"packages": ["kmtest-app; python_version<'3'"]},
    {"packages": [""]}, {"packages": ["x" * 300]}, {"packages": ["kmtest-app"], "extra": 1}, {},
])
def test_bad_requests_are_422(api, shared_sid, body) -> None:
    r = api.post(f"/v1/sessions/{shared_sid}/packages", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("text", ["-e .", "kmtest-app @ http://127.0.0.1/x.whl", "../etc", "kmtest-app-1.0.tar.gz"])
def test_what_pip_could_read_as_a_file_is_403(api, shared_sid, text) -> None:
    """(The canaries that prove nothing is built: security/test_packages.py.)"""
    r = api.post(f"/v1/sessions/{shared_sid}/packages", json={"packages": [text]})
    assert r.status_code == 403, r.text
    assert r.json()["error"]["details"]["rule"] == "index_names_only"


def test_unknown_session_is_404(api) -> None:
    r = install(api, "no-such-session", "kmtest-app")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "session_not_found"


def test_pip_install_in_a_cell(api, new_session) -> None:
    sid = new_session()
    out = run(api, sid, "%pip install kmtest-app==1.0\nimport kmtest_app\nprint(kmtest_app.answer())")
    assert out["status"] == "ok", out
    assert "Successfully installed" in out["stdout"] and out["stdout"].strip().endswith("42")
    out = run(api, sid, "!pip install -q kmtest-native\nimport kmtest_native\nprint(kmtest_native.PLATFORM)")
    assert out["status"] == "ok", out
    assert out["stdout"].strip().endswith("manylinux")
    out = run(api, sid, "%pip install kmtest-denied")
    assert out["status"] == "error"
    assert out["error"]["ename"] == "ToolError"
    assert "package_refused" in out["error"]["evalue"] and "kmtest-denied" in out["error"]["evalue"]
    out = run(api, sid, "%pip uninstall kmtest-app")
    assert out["status"] == "error" and "only `pip install" in out["error"]["evalue"]
    # An ordinary shell command still runs as before.
    assert run(api, sid, "!echo hello")["stdout"].strip() == "hello"


def test_a_session_created_with_packages(api, pkg_server) -> None:
    r = api.post("/v1/sessions", json={"packages": ["kmtest-app"]})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    try:
        assert run(api, sid, "import kmtest_app; print(kmtest_app.answer())")["stdout"].strip() == "42"
    finally:
        api.delete(f"/v1/sessions/{sid}")
    r = api.post("/v1/sessions", json={"session_id": "with-denied", "packages": ["kmtest-denied"]})
    assert r.status_code == 403, r.text
    assert api.get("/v1/sessions/with-denied").status_code == 404  # not left half-made
    r = api.post("/v1/sessions", json={"packages": ["-r requirements.txt"]})
    assert r.status_code == 403 and r.json()["error"]["details"]["rule"] == "index_names_only"


def test_client_install(pkg_server, index) -> None:
    with Client(pkg_server.url, pkg_server.token) as km, km.create_session(packages=["kmtest-native"]) as s:
        assert s.execute("import kmtest_native; kmtest_native.PLATFORM").result == "'manylinux'"
        result = s.install("kmtest-app")
        assert {p.name for p in result.installed} == {"kmtest-app", "kmtest-lib"}
        with pytest.raises(PackageRefused):
            s.install("kmtest-denied")
        with pytest.raises(NoWheel):
            s.install("kmtest-sdist-only")


def test_every_install_is_audited(api, new_session, pkg_server) -> None:
    sid = new_session()
    install(api, sid, "kmtest-app")
    install(api, sid, "kmtest-denied")
    lines = [json.loads(line[line.index("{"):]) for line in pkg_server.log().splitlines()
             if '"event": "package_install"' in line and sid in line]
    assert [(x["ok"], x.get("code")) for x in lines] == [(True, None), (False, "package_refused")]
    assert lines[0]["installed"] or lines[0]["already"]


async def test_mcp_install_packages(pkg_server) -> None:
    from mcp_types import TextContent

    from tests.mcp.conftest import mcp_client

    async with mcp_client(pkg_server) as client:
        r = await client.call_tool("install_packages", {"packages": ["kmtest-app"]})
        assert not r.is_error, r
        assert {p["name"] for p in r.structured_content["installed"]} == {"kmtest-app", "kmtest-lib"}
        assert "installed kmtest-app 1.0" in "".join(b.text for b in r.content if isinstance(b, TextContent))
        run = await client.call_tool("run_python", {"code": "import kmtest_app; kmtest_app.answer()"})
        assert not run.is_error and run.structured_content["result"] == "42"
        refused = await client.call_tool("install_packages", {"packages": ["kmtest-denied"]})
        assert refused.is_error and refused.structured_content["error"]["code"] == "package_refused"
        as_file = await client.call_tool("install_packages", {"packages": ["kmtest-app-1.0.tar.gz"]})
        assert as_file.is_error and as_file.structured_content["error"]["details"]["rule"] == "index_names_only"
        bad = await client.call_tool("install_packages", {"packages": []})
        assert bad.is_error
