"""Fixtures of the adapter tests: a kernelmode.Client on the shared server, a server with host
tools, and running an example as a subprocess against a server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kernelmode import Client
from tests.conftest import REPO, Server, start_server

HOST_TOOLS = """
tools:
  - {name: add, function: "tests.integration.host_tools:add"}
  - {name: weather, function: "tests.integration.host_tools:weather"}
"""


@pytest.fixture()
def km(server: Server) -> Iterator[Client]:
    with Client(server.url, server.token) as c:
        yield c


@pytest.fixture(scope="package")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose kernels can call the host tools ``tools.add`` and ``tools.weather``."""
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"
    cfg.write_text(HOST_TOOLS)
    srv = start_server(args=["--config", str(cfg)])
    yield srv
    srv.discard()


def run_example(name: str, server: Server, tmp_path: os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KERNELMODE_URL": server.url, "KERNELMODE_TOKEN": server.token,
           "CREWAI_DISABLE_TELEMETRY": "true", "OTEL_SDK_DISABLED": "true",
           "XDG_DATA_HOME": str(tmp_path)}  # CrewAI makes storage folders there on import
    proc = subprocess.run([sys.executable, str(REPO / "examples" / name)], capture_output=True,
                          text=True, timeout=180, cwd=str(REPO), env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc
