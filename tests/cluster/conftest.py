"""The cluster rig's fixtures: two node namespaces, Enterprise Gateway over SSH on them, and one
`serve` with ``gateway.url`` pointed at that EG, each brought up once per module.

The tests skip (with the reason) only when the machine lacks a capability the rig needs (root,
sshd, nftables, EG's virtualenv: `make setup-cluster`); any other failure is a failure.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Server, start_server
from tests.support.cluster import eg as eg_mod
from tests.support.cluster import rig as rig_mod

SERVE_CONFIG = """
tools:
  - {name: add, function: "tests.integration.host_tools:add"}
"""


@pytest.fixture(scope="module")
def rig() -> Iterator[rig_mod.Rig]:
    why = rig_mod.missing() or eg_mod.missing()
    if why:
        pytest.skip(why)
    r = rig_mod.claim()
    try:
        yield r
    finally:
        r.down()


@pytest.fixture(scope="module")
def eg(rig: rig_mod.Rig) -> Iterator[eg_mod.EnterpriseGateway]:
    g = eg_mod.start(rig)
    try:
        yield g
    finally:
        g.stop()


@pytest.fixture(scope="module")
def served(eg: eg_mod.EnterpriseGateway) -> Iterator[Server]:
    """`serve` driving the rig's EG (a pool of one: it refills on the nodes)."""
    data_dir = Path(tempfile.mkdtemp(prefix="kmcluster-", dir="/tmp"))
    cfg = data_dir.with_suffix(".yaml")
    cfg.write_text(SERVE_CONFIG)
    srv = start_server({**eg.env(), "KERNELMODE_SESSIONS__POOL_SIZE": "1"}, data_dir=data_dir,
                       args=["--config", str(cfg)])
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
        cfg.unlink(missing_ok=True)
        data_dir.with_suffix(".log").unlink(missing_ok=True)
