"""Egress in a session's life: the session's proxy (kernelmode.egress) follows its kernel.

A session with egress has its proxy listening in its kernel's egress dir (sandbox/egress.py) for
as long as it has a kernel: ``attach`` when a kernel starts for it (``Kernels.launch``: a new
kernel, a replaced one after a death or a wake), when a warm kernel is claimed for it and when
its kernel is adopted after a manager restart; ``detach`` when it ends or hibernates. A restarted
kernel keeps its id and its dir, so its socket stays. ``Egress.open`` is idempotent: attaching
again is a dict lookup. The runner marks each run (``run_started``) and reads its usage.

A kernel on an external gateway has no egress dir: ``remote_launch`` gives it its own token and
the address of `kernelmode egress-proxy` (egress/front.py), which finds its session by kernel id.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Settings
from ..egress.credentials import new_token
from ..egress.policy import EgressPolicy, stored_policy
from ..egress.service import Egress
from ..errors import KernelUnavailable, SessionStoreUnavailable
from ..metrics import Metrics
from ..models import EgressUse
from ..sandbox.egress import ENV_CA, ENV_PROXY, ENV_TOKEN, egress_dir
from .store.egress_tokens import EgressTokens

if TYPE_CHECKING:  # kernels.py holds a wiring: importing it here would be a cycle
    from .kernels import Kernel

log = logging.getLogger("kernelmode.sessions")


class EgressWiring:
    """``root``: the gateway's runtime dir, where each kernel's egress dir is (None: the kernels
    have none, unsandboxed or on a gateway elsewhere, and no proxy is opened)."""

    def __init__(self, settings: Settings, data_dir: Path, metrics: Metrics | None, root: Path | None,
                 tokens: EgressTokens | None = None) -> None:
        self.settings = settings.egress
        self.root = root
        self.tokens = tokens
        self.service = Egress(data_dir, metrics, settings.egress.ca_dir)
        self._policies: dict[str, EgressPolicy] = {}  # session id -> its policy, rebuilt once

    def dir_of(self, kernel_id: str) -> Path | None:
        return None if self.root is None else egress_dir(self.root, kernel_id)

    async def attach(self, k: Kernel) -> None:
        """Open (or move) the proxy of ``k``'s session into ``k``'s egress dir. A warm kernel
        (no session yet) and a session without egress get none: the bridge then refuses."""
        info = k.info
        where = self.dir_of(k.kernel_id)
        if info.egress is None or where is None or k.env.remote:
            return
        sid = info.session_id
        policy = self._policies.get(sid)
        if policy is None:  # secrets and addresses come from the settings of now (a restart)
            policy = self._policies[sid] = stored_policy(self.settings, info.egress)
        try:
            await self.service.open(sid, info.tenant, policy, where)
        except OSError as e:  # the dir went with its kernel, or a data dir path too long for a socket
            raise KernelUnavailable(f"the session's egress proxy could not listen in {where}: {e}") from e

    def remote_launch(self, kernel_id: str) -> dict[str, str]:
        """The ``KERNEL_*`` values that give a kernel on an external gateway its egress: a fresh
        token (only its hash is stored) and the proxy's address; {} when egress.proxy_address is
        unset; with egress.remote_ca_bundle, that bundle's path on the node/pod too. Minted for every kernel, pool ones too: the session is looked up per request."""
        if self.settings.proxy_address is None or self.tokens is None:
            return {}
        token = new_token()
        self.tokens.add(kernel_id, token)
        launch = {ENV_TOKEN: token, ENV_PROXY: self.settings.proxy_address}
        if self.settings.remote_ca_bundle is not None:
            launch[ENV_CA] = self.settings.remote_ca_bundle
        return launch

    def forget(self, kernel_id: str) -> None:
        """The kernel is gone: its token opens nothing any more. A store that cannot answer
        does not stop a teardown: the token's kernel has no session either way."""
        if self.tokens is not None and self.settings.proxy_address is not None:
            try:
                self.tokens.forget(kernel_id)
            except SessionStoreUnavailable as e:
                log.warning("kernel %s: its egress token stays in the store (%s)", kernel_id, e.message)

    async def detach(self, session_id: str) -> None:
        self._policies.pop(session_id, None)
        await self.service.close(session_id)

    def run_started(self, session_id: str, run_id: str | None) -> None:
        """Connections opened from now on count toward ``run_id`` (None: the run ended)."""
        self.service.set_run(session_id, run_id)

    def usage(self, session_id: str, run_id: str) -> list[EgressUse]:
        """The run's ``RunResult.egress``: hosts reached and refused."""
        return self.service.usage(session_id, run_id)

    async def stop(self) -> None:
        self._policies.clear()
        await self.service.stop()


@contextlib.contextmanager
def counted(k: Kernel, run_id: str) -> Iterator[Callable[[], list[EgressUse]]]:
    """Egress connections ``k`` opens inside the block count toward ``run_id``; the callable it
    yields gives the run's ``RunResult.egress`` afterwards ([] without egress)."""
    wiring, sid = k.env.egress, k.info.session_id
    if wiring is None:
        yield list
        return
    wiring.run_started(sid, run_id)
    try:
        yield lambda: wiring.usage(sid, run_id)
    finally:
        wiring.run_started(sid, None)
