"""What every kernel shares (the gateway, the workspace volumes, the tool broker, the package
layers, the settings), and the start of new kernels (cf. jupyter_client's multikernelmanager):
``Kernels.new`` gives a started, connected, preamble-ready ``Kernel`` (kernels.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..artifacts.volume import WorkspaceVolumes
from ..audit import audit
from ..config import ADMIN_TENANT, Settings
from ..errors import KernelmodeError, KernelUnavailable, SandboxUnavailable
from ..gateway.client import GatewayClient
from ..gateway.execution import OutputCollector
from ..models import SessionInfo
from ..packages.service import PackageService
from ..protocol import memory_hint
from ..sandbox.spec import pop_death, pop_death_record
from ..tools.broker import ToolBroker
from .kernels import Kernel

if TYPE_CHECKING:  # egress_wiring.py reads kernels: importing it here would be a cycle
    from .egress_wiring import EgressWiring

log = logging.getLogger("kernelmode.sessions")
OUTPUT_NOTE = "; its last output: "  # in the message of a kernel that died as it started


def public_text(e: KernelmodeError) -> str:
    """``e``'s message for a public route (/readyz): a dead kernel's own output (``died_at_start``)
    left out; the server's log has it."""
    output = e.details.get("output") if isinstance(e.details, dict) else None
    if not output:
        return e.message
    return e.message.replace(f"{OUTPUT_NOTE}{output!r}", "; its last output is in the server's log")


def told(e: SandboxUnavailable, tenant: str | None) -> SandboxUnavailable:
    """``e`` as ``tenant`` is told it: what a kernel that died as it started printed may name the
    host's paths and settings, the operator's to read (the admin token, the log), not a tenant's."""
    details = e.details if isinstance(e.details, dict) else {}
    if tenant in (None, ADMIN_TENANT) or not details.get("output"):
        return e
    return SandboxUnavailable(public_text(e), details={k: v for k, v in details.items() if k != "output"})


class KernelMarks(Protocol):
    def mark(self, kernel_id: str) -> None: ...

    def unmark(self, kernel_id: str) -> None: ...


@dataclass
class Kernels:
    """What every kernel shares (gateway, volumes, broker, settings); starts new kernels."""

    settings: Settings
    gateway: GatewayClient
    volumes: WorkspaceVolumes
    state_dir: Path
    broker: ToolBroker
    packages: PackageService | None = None  # the package layers, mounted into each kernel
    egress: EgressWiring | None = None  # the sessions' egress proxies, in the kernels' egress dirs
    # Several managers on one store: each kernel marked as this manager's before it starts
    # (ownership.py), unmarked once shut down, so that a dead manager's kernels are found.
    marks: KernelMarks | None = None
    # Background DELETEs of kernels given up (lost, or a failed start): nothing waits on them.
    retiring: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def remote(self) -> bool:
        """Kernels on a gateway the manager did not start (``gateway.url``): their workspaces
        live with them, none is made on this disk (no loop volume, no package layer)."""
        return self.settings.gateway.url is not None

    @property
    def start_timeout(self) -> float:
        gw = self.settings.gateway
        return gw.launch_timeout_seconds if gw.url else self.settings.sessions.kernel_start_timeout_seconds

    def collector(self) -> OutputCollector:
        cfg = self.settings.sessions
        return OutputCollector(cfg.max_output_bytes, max_display_bytes=cfg.max_display_bytes)

    def retire(self, kernel_id: str) -> None:
        """Ask the gateway to DELETE a kernel, in the background and bounded: a gateway whose
        node is gone can hold a DELETE for 30 s and then fail (Enterprise Gateway does)."""
        async def delete() -> None:
            try:
                await asyncio.wait_for(self.gateway.shutdown_kernel(kernel_id, self.settings.gateway.
                                                                    shutdown_timeout_seconds),
                                       self.settings.gateway.shutdown_timeout_seconds + 1)
                log.info("kernel %s: shut down in the background", kernel_id)
            except (KernelmodeError, asyncio.TimeoutError) as e:
                log.warning("kernel %s: the gateway did not shut it down (%s); left to the gateway",
                            kernel_id, e)
                audit("kernel_orphaned", kernel_id=kernel_id, error=str(e)[:300])
            pop_death_record(self.state_dir, kernel_id)
            if self.marks is not None:
                self.marks.unmark(kernel_id)

        if self.egress is not None:
            self.egress.forget(kernel_id)
        task = asyncio.create_task(delete(), name=f"retire-{kernel_id}")
        self.retiring.add(task)
        task.add_done_callback(self.retiring.discard)

    async def new(self, info: SessionInfo) -> Kernel:
        """A started, connected, preamble-ready kernel: up to ``gateway.launch_attempts`` starts
        (a gateway with several nodes may place each on another), then KernelUnavailable (503)
        saying why the last one failed."""
        attempts = self.settings.gateway.launch_attempts
        for attempt in range(1, attempts + 1):
            try:
                return await self._start(info)
            except SandboxUnavailable as e:  # the sandbox refused these limits: another try gets the same answer
                audit("kernel_start_failed", session_id=info.session_id, attempt=attempt, error=e.message[:300])
                raise
            except KernelmodeError as e:
                if attempt == attempts:
                    raise KernelUnavailable(f"could not start a kernel ({attempts} attempt(s)); "
                                            f"the last failed with: {e.message}") from e
                log.warning("kernel start %d of %d failed (%s); trying again", attempt, attempts, e.message)
                audit("kernel_start_failed", session_id=info.session_id, attempt=attempt, error=e.message[:300])
        raise AssertionError("unreachable")

    def died_at_start(self, k: Kernel) -> SandboxUnavailable | None:
        """The error of a start whose kernel the provisioner saw die (its death record: the
        cause and its last output), None if it did not. The gateway restarted it and each
        restart died too (else the connect would have gone through): another try gets the same
        answer, so SandboxUnavailable, which is not retried."""
        died = pop_death(self.state_dir, k.kernel_id)
        if died is None:
            return None
        cause, output = died
        how = (f"exit status {cause.exit_code}" if cause.kind == "exit" else
               f"killed by signal {cause.signal}" if cause.kind == "signal" else
               "killed for memory" if cause.kind == "oom" else "cause unknown")
        log.warning("kernel %s died as it started (%s)%s", k.kernel_id, how, f"{OUTPUT_NOTE}{output!r}" if output else "")
        said = f"{OUTPUT_NOTE}{output!r}" if output else "; it wrote nothing"
        todo = (memory_hint(k.info.limits.memory_mb) if cause.kind == "oom" else
                "The sandbox or the kernel environment cannot run kernels as configured: run "
                "`kernelmode doctor` with the server's settings and see the server's log")
        return told(SandboxUnavailable(f"the kernel died as it started ({how}), and so did the gateway's "
                                       f"restarts of it{said}. {todo}",
                                       details={"cause": cause.model_dump(), "output": output}), k.info.tenant)

    async def _start(self, info: SessionInfo) -> Kernel:
        """Start a sandboxed kernel with its own workspace, connect, install the preamble."""
        kernel_id = str(uuid.uuid4())
        workspace = self.volumes.root / kernel_id
        if self.remote:  # the gateway's kernel makes its own workspace
            return await self._start_kernel(Kernel(self, kernel_id, workspace, info))
        create = asyncio.ensure_future(asyncio.to_thread(self.volumes.create, workspace, info.limits.disk_mb))
        try:
            await asyncio.shield(create)
        except asyncio.CancelledError:
            # Cancelling does not stop the thread: it would mount the volume after the stop's
            # sweep, and the mount would outlive the server. Undo it once it is made.
            with contextlib.suppress(Exception):
                await create
            with contextlib.suppress(KernelmodeError):
                await asyncio.to_thread(self.volumes.destroy, workspace)
            raise
        k = Kernel(self, kernel_id, workspace, info)
        if k.layer is not None:
            await asyncio.to_thread(k.layer.create)
        return await self._start_kernel(k)

    async def _start_kernel(self, k: Kernel) -> Kernel:
        kernel_id = k.kernel_id
        try:
            await asyncio.wait_for(self.launch(k), self.start_timeout + 5)
        except asyncio.TimeoutError:
            # A start past its deadline may still come up later: DELETEd in the background.
            await k.discard(shutdown=False)
            self.retire(kernel_id)
            raise KernelUnavailable(f"the kernel did not start within {self.start_timeout:g} s") from None
        except BaseException:
            await k.discard(shutdown=False)
            self.retire(kernel_id)
            raise
        return k

    async def launch(self, k: Kernel) -> None:
        """Start ``k`` (its id) in the gateway and connect to it; SandboxUnavailable when the
        kernel died as it started (``died_at_start``)."""
        if self.marks is not None:
            self.marks.mark(k.kernel_id)
        await self.gateway.start_kernel(k.kernel_id, k.start_env(), self.start_timeout)
        try:
            await k.connect(self.start_timeout)
        except KernelmodeError as e:
            died = self.died_at_start(k)
            if died is None:
                raise
            raise died from e
        if self.egress is not None:  # its session's proxy moves into this kernel's egress dir
            await self.egress.attach(k)
