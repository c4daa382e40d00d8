"""A real S3 API for the artifact-store tests: moto's server mode, as a subprocess on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kernelmode.config import ArtifactSettings


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # "127.0.0.1:PORT", as ArtifactSettings.endpoint wants it
    access_key: str
    secret_key: str

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"


def free_port() -> int:
    """A loopback port nobody listens on (the kernel just handed it out and it was closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_moto(env_extra: dict[str, str] | None = None) -> Iterator[S3Server]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="moto-", suffix=".log")[1])
    env = {**os.environ, **(env_extra or {})}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moto server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/moto-api/", timeout=1,
                             trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"moto server did not answer within 30 s:\n{log.read_text()}")
            time.sleep(0.05)
        yield S3Server(endpoint=f"127.0.0.1:{port}", access_key="testing", secret_key="testing")
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server; it accepts any credentials and does not check signatures."""
    yield from _start_moto()


@pytest.fixture(scope="session")
def s3_auth_server() -> Iterator[S3Server]:
    """moto with IAM authentication on from the first request: unknown access keys are refused
    (InvalidAccessKeyId), as a real S3 would."""
    yield from _start_moto({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})


def _settings(server: S3Server, **overrides: object) -> ArtifactSettings:
    fields: dict[str, object] = {
        "store": "s3",
        "endpoint": server.endpoint,
        "access_key": server.access_key,
        "secret_key": server.secret_key,
        "bucket": f"km-test-{uuid.uuid4().hex[:16]}",
        "secure": False,
    }
    fields.update(overrides)
    return ArtifactSettings.model_validate(fields)


@pytest.fixture()
def s3_settings(s3_server: S3Server) -> ArtifactSettings:
    """Settings for the moto server, with a bucket of its own (not yet created)."""
    return _settings(s3_server)


@pytest.fixture()
def dead_settings() -> ArtifactSettings:
    """Settings pointing at a loopback port nobody listens on."""
    return _settings(S3Server(f"127.0.0.1:{free_port()}", "testing", "testing"))
