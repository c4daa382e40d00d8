"""sessions/egress_wiring.py without a gateway: a session's proxy follows its kernel's egress dir
(opened, moved to a replacing kernel's, closed), a warm kernel gets none, and a dir it cannot
listen in is a KernelUnavailable that says where, not an internal error."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from kernelmode.config import Settings
from kernelmode.egress.policy import egress_info, server_policy
from kernelmode.errors import KernelUnavailable
from kernelmode.models import Limits, SessionInfo
from kernelmode.sessions.egress_wiring import EgressWiring
from kernelmode.sessions.kernel_env import Kernels
from kernelmode.sessions.kernels import Kernel

SETTINGS = Settings.model_validate({"egress": {"allow": ["api.example.com"]}})


def _kernel(kernels: Kernels, kernel_id: str, sid: str = "s1", egress: bool = True) -> Kernel:
    t = datetime.now(timezone.utc)
    info = SessionInfo(session_id=sid, status="idle", created_at=t, last_activity=t, ttl_seconds=60,
                       limits=Limits(), sandbox="bwrap",
                       egress=egress_info(server_policy(SETTINGS.egress)) if egress else None)
    return Kernel(kernels, kernel_id, Path("/nonexistent"), info)


async def test_the_proxy_follows_the_sessions_kernel(tmp_path: Path) -> None:
    wiring = EgressWiring(SETTINGS, tmp_path, None, tmp_path / "run")
    kernels = Kernels(SETTINGS, None, None, tmp_path, None, egress=wiring)  # type: ignore[arg-type]
    for kid in ("k1", "k2", "pool"):
        (tmp_path / "run" / f"{kid}.egress").mkdir(parents=True)
    try:
        k = _kernel(kernels, "k1")
        await wiring.attach(k)
        await wiring.attach(k)  # again: nothing changes
        assert (tmp_path / "run" / "k1.egress" / "proxy.sock").exists()
        k.kernel_id = "k2"  # replaced (a death, a wake): the proxy moves
        await wiring.attach(k)
        assert not (tmp_path / "run" / "k1.egress" / "proxy.sock").exists()
        assert (tmp_path / "run" / "k2.egress" / "proxy.sock").exists()
        await wiring.attach(_kernel(kernels, "pool", sid="pool", egress=False))  # a warm kernel: none
        assert not (tmp_path / "run" / "pool.egress" / "proxy.sock").exists()
        await wiring.detach("s1")
        assert not (tmp_path / "run" / "k2.egress" / "proxy.sock").exists()
        assert (tmp_path / "run" / "k2.egress" / "ca-bundle.pem").exists()  # the kernel's CA variables name it
    finally:
        await wiring.stop()


async def test_a_dir_it_cannot_listen_in_says_where(tmp_path: Path) -> None:
    wiring = EgressWiring(SETTINGS, tmp_path, None, tmp_path / "run")
    kernels = Kernels(SETTINGS, None, None, tmp_path, None, egress=wiring)  # type: ignore[arg-type]
    with pytest.raises(KernelUnavailable, match="egress proxy could not listen in .*gone.egress"):
        await wiring.attach(_kernel(kernels, "gone"))
    await wiring.stop()


def test_a_remote_kernel_start_carries_a_fresh_token_stored_only_as_a_hash(tmp_path: Path) -> None:
    """A kernel on an external gateway gets its own token and the proxy's address as checked
    KERNEL_* values; the store holds the token's hash, which finds the kernel until it is gone."""
    from kernelmode.egress.credentials import token_hash
    from kernelmode.sandbox.egress import ENV_PROXY, ENV_TOKEN
    from kernelmode.sessions.store import SqliteStore

    settings = Settings.model_validate({"gateway": {"url": "http://eg.example:8888"},
                                        "egress": {"allow": ["api.example.com"],
                                                   "proxy_address": "egress-proxy.kernelmode.svc:3128"}})
    store = SqliteStore(tmp_path / "s.sqlite3")
    wiring = EgressWiring(settings, tmp_path, None, None, store.egress_tokens)
    kernels = Kernels(settings, None, None, tmp_path, None, egress=wiring)  # type: ignore[arg-type]
    env_a = _kernel(kernels, "11111111-1111-4111-8111-111111111111").start_env()
    env_b = _kernel(kernels, "22222222-2222-4222-8222-222222222222").start_env()
    token = env_a[ENV_TOKEN]
    assert env_a[ENV_PROXY] == "egress-proxy.kernelmode.svc:3128" and len(token) == 48
    assert env_b[ENV_TOKEN] != token  # one per kernel
    assert store.egress_tokens.kernel_of(token) == "11111111-1111-4111-8111-111111111111"
    dump = "\n".join(line for line in store._db.iterdump())  # type: ignore[attr-defined]
    assert token not in dump and token_hash(token) in dump
    wiring.forget("11111111-1111-4111-8111-111111111111")
    assert store.egress_tokens.kernel_of(token) is None
    # Without egress.proxy_address a remote kernel gets no token.
    plain = Settings.model_validate({"gateway": {"url": "http://eg.example:8888"}})
    bare = EgressWiring(plain, tmp_path, None, None, store.egress_tokens)
    env = _kernel(Kernels(plain, None, None, tmp_path, None, egress=bare), "k3").start_env()  # type: ignore[arg-type]
    assert ENV_TOKEN not in env and ENV_PROXY not in env
    store.close()
