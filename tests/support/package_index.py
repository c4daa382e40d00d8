"""A real package index on loopback for the package tests: wheels and an sdist built here (no
network, ever), laid out as a PEP 503 "simple" index and served by http.server on 127.0.0.1.

What it holds (each a case the issue names):
- ``kmtest-app`` 1.0, which depends on ``kmtest-lib`` (a package with dependencies);
- ``kmtest-native`` 1.0, a ``cp311-cp311-manylinux_2_17_x86_64`` wheel (platlib under .data):
  only found when pip targets the kernel's platform;
- ``kmtest-maconly`` 1.0: a macOS wheel only (no wheel for the kernel: no_wheel);
- ``kmtest-sdist-only`` 1.0: a source distribution only (never built on the host: no_wheel);
- ``kmtest-denied`` 1.0 (deny-listed by name) and ``kmtest-usesevil`` 1.0, whose dependency
  ``kmtest-evil`` is deny-listed by a glob;
- ``kmtest-conflict`` 1.0, which depends on ``tornado<5`` (the kernel's ipykernel needs its own);
- ``kmtest-big`` 1.0, a wheel of 1.5 MB of random bytes (over a 1 MB download cap);
- ``kmtest-traversal`` 1.0, a wheel with a ``../../`` member (refused at unpacking).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import os
import re
import shutil
import tarfile
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

PY_TAG = "py3-none-any"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(out: Path, name: str, version: str, files: dict[str, bytes], requires: list[str] = (),
                tag: str = PY_TAG, purelib: bool = True) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD)."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)]).encode()
    wheel = (f"Wheel-Version: 1.0\nGenerator: kernelmode-tests\nRoot-Is-Purelib: "
             f"{'true' if purelib else 'false'}\nTag: {tag}\n").encode()
    entries = {(p if purelib else f"{dist}-{version}.data/platlib/{p}"): d for p, d in files.items()}
    entries[f"{info}/METADATA"] = meta
    entries[f"{info}/WHEEL"] = wheel
    record = "\n".join(_record_line(p, d) for p, d in entries.items()) + f"\n{info}/RECORD,,\n"
    path = out / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for p, d in entries.items():
            zf.writestr(p, d)
        zf.writestr(f"{info}/RECORD", record)
    return path


def build_sdist(out: Path, name: str, version: str, canary: Path) -> Path:
    """An sdist whose setup.py, if anything ever ran it on the host, would leave ``canary``."""
    dist = name.replace("-", "_")
    path = out / f"{dist}-{version}.tar.gz"
    setup = (f"open({str(canary)!r}, 'w').write('ran')\n"
             "raise SystemExit('this setup.py must never run on the kernelmode host')\n").encode()
    pkg_info = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    with tarfile.open(path, "w:gz") as tf:
        for member, data in ((f"{dist}-{version}/setup.py", setup), (f"{dist}-{version}/PKG-INFO", pkg_info)):
            ti = tarfile.TarInfo(member)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def canary_project(canary: Path) -> dict[str, bytes]:
    """A PEP 517 project whose in-tree build backend writes ``canary`` the moment it is imported:
    pip, asked for metadata, a wheel or its build requirements, always imports it first."""
    backend = (f"open({str(canary)!r}, 'a').write('ran\\n')\n"
               "def _never(*a, **k):\n    raise SystemExit('this backend must never run on the kernelmode host')\n"
               "get_requires_for_build_wheel = prepare_metadata_for_build_wheel = build_wheel = _never\n"
               "get_requires_for_build_editable = build_editable = build_sdist = _never\n").encode()
    return {"pyproject.toml": b'[build-system]\nrequires = []\nbuild-backend = "canary_backend"\n'
                              b'backend-path = ["."]\n\n[project]\nname = "canary"\nversion = "1.0"\n',
            "canary_backend.py": backend,
            "PKG-INFO": b"Metadata-Version: 2.1\nName: canary\nVersion: 1.0\n"}


def plant_canaries(where: Path, canary: Path) -> None:
    """Everything pip could build if it read a requirement as a file of ``where``: the project
    itself (``.``), in ``canary/``, and as ``canary-1.0.tar.gz``, ``.tgz``, ``.zip`` and a wheel
    (uppercase names too, for a case-insensitive disk)."""
    where.mkdir(parents=True, exist_ok=True)
    files = canary_project(canary)
    for base in (where, where / "canary"):
        base.mkdir(exist_ok=True)
        for name, data in files.items():
            (base / name).write_bytes(data)
    for stem in ("canary-1.0", "CANARY-1.0"):
        for suffix in (".tar.gz", ".tgz"):
            with tarfile.open(where / f"{stem}{suffix}", "w:gz") as tf:
                for name, data in files.items():
                    ti = tarfile.TarInfo(f"canary-1.0/{name}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
        with zipfile.ZipFile(where / f"{stem}.zip", "w") as zf:
            for name, data in files.items():
                zf.writestr(f"canary-1.0/{name}", data)
    build_wheel(where, "canary", "1.0", {"canary.py": b"X = 1\n"})


def build_traversal_wheel(out: Path) -> Path:
    """A wheel with a member that climbs out of the install directory."""
    path = build_wheel(out, "kmtest-traversal", "1.0", {"kmtest_traversal.py": b"X = 1\n"})
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("../../kmtest_escaped.py", b"ESCAPED = True\n")
    return path


def build_all(out: Path, canary: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    mod = lambda text: text.encode()  # noqa: E731
    return [
        build_wheel(out, "kmtest-lib", "1.0", {"kmtest_lib/__init__.py": mod("VALUE = 41\n")}),
        build_wheel(out, "kmtest-app", "1.0", {"kmtest_app/__init__.py": mod(
            "from kmtest_lib import VALUE\n\ndef answer():\n    return VALUE + 1\n")}, ["kmtest-lib>=1.0"]),
        build_wheel(out, "kmtest-native", "1.0", {"kmtest_native.py": mod("PLATFORM = 'manylinux'\n")},
                    tag="cp311-cp311-manylinux_2_17_x86_64", purelib=False),
        build_wheel(out, "kmtest-maconly", "1.0", {"kmtest_maconly.py": mod("X = 1\n")},
                    tag="cp311-cp311-macosx_11_0_arm64"),
        build_sdist(out, "kmtest-sdist-only", "1.0", canary),
        build_traversal_wheel(out),
        build_wheel(out, "kmtest-denied", "1.0", {"kmtest_denied.py": mod("X = 1\n")}),
        build_wheel(out, "kmtest-evil", "1.0", {"kmtest_evil.py": mod("X = 1\n")}),
        build_wheel(out, "kmtest-usesevil", "1.0", {"kmtest_usesevil.py": mod("import kmtest_evil\n")},
                    ["kmtest-evil"]),
        build_wheel(out, "kmtest-conflict", "1.0", {"kmtest_conflict.py": mod("X = 1\n")}, ["tornado<5"]),
        build_wheel(out, "kmtest-big", "1.0", {"kmtest_big/blob.bin": os.urandom(1_500_000)}),
    ]


def _project(filename: str) -> str:
    base = filename.removesuffix(".tar.gz").removesuffix(".whl")
    return re.sub(r"[-_.]+", "-", base.split("-")[0]).lower()


def write_simple_index(files: list[Path], root: Path) -> None:
    """PEP 503: /simple/<project>/index.html linking each file with its sha256."""
    simple = root / "simple"
    by_project: dict[str, list[Path]] = {}
    for f in files:
        by_project.setdefault(_project(f.name), []).append(f)
    for project, fs in by_project.items():
        d = simple / project
        d.mkdir(parents=True, exist_ok=True)
        links = []
        for f in fs:
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            (d / f.name).write_bytes(f.read_bytes())
            links.append(f'<a href="{f.name}#sha256={digest}">{f.name}</a><br>')
        (d / "index.html").write_text("<!DOCTYPE html><html><body>" + "".join(links) + "</body></html>")
    (simple / "index.html").write_text("<html><body>" + "".join(
        f'<a href="{p}/">{p}</a>' for p in sorted(by_project)) + "</body></html>")


@dataclass
class PackageIndex:
    url: str  # .../simple
    requests: list[str] = field(default_factory=list)  # paths asked for, in order
    tmp: Path = Path()  # where it was built
    canary: Path = Path()  # appears if the sdist's setup.py ever ran on the host


@contextmanager
def serve_index(root: Path) -> Iterator[PackageIndex]:
    """Serve ``root`` on 127.0.0.1 (a free port) while the block runs."""
    index = PackageIndex(url="")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

        def do_GET(self) -> None:  # noqa: N802
            index.requests.append(self.path)
            super().do_GET()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    index.url = f"http://127.0.0.1:{httpd.server_address[1]}/simple/"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield index
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextmanager
def local_index(tmp: Path) -> Iterator[PackageIndex]:
    """Build every test package under ``tmp`` and serve them as an index."""
    canary = tmp / "HOST-RAN-SETUP-PY"
    write_simple_index(build_all(tmp / "dist", canary), tmp / "index")
    with serve_index(tmp / "index") as index:
        index.tmp, index.canary = tmp, canary
        yield index


@contextmanager
def temporary_index() -> Iterator[PackageIndex]:
    """``local_index`` in a temporary folder, removed afterwards (the test modules' fixture)."""
    tmp = Path(tempfile.mkdtemp(prefix="kmtest-index-"))
    try:
        with local_index(tmp) as index:
            yield index
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def index_env(index: PackageIndex, tmp: Path) -> dict[str, str]:
    """The server settings the package tests use (the host's pip configuration, cache and
    find-links kept out: only the local index answers)."""
    (tmp / "no-links").mkdir(exist_ok=True)
    return {
        "KERNELMODE_PACKAGES__INDEX_URL": index.url,
        "KERNELMODE_PACKAGES__DENY": "[kmtest-denied, 'kmtest-evil*']",
        "KERNELMODE_PACKAGES__MAX_DOWNLOAD_MB": "1",
        "PIP_NO_CACHE_DIR": "1",  # every first download reaches the index (counted by the tests)
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": str(tmp / "no-links"),
        "PIP_EXTRA_INDEX_URL": "",
    }
