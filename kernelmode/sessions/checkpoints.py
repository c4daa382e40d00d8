"""Checkpoints: a session's variables and workspace files, kept in the artifact store, so that a
session outlives its kernel (restore after death, forks, hibernation).

The variables are serialised INSIDE the kernel (``kernel/snapshot.py``) into one file under the
workspace's ``.kernelmode-checkpoint/`` folder; the manager moves that file, unread, into the
store under ``.checkpoints/{id}/`` (a prefix no download link serves) and never unpickles it.
A restore writes it back there for a fresh kernel, which loads it. The workspace files go in as
a tar made here from the bounded, link-free workspace walk, at most ``limits.disk_mb`` read
(``checkpoint_files.py``). The kernel's answers are untrusted input (``snapshot_call.py``). A take
that does not end in a record leaves no object behind. Metadata (names, sizes, tenant) is in
the session store; every lookup checks the tenant (another tenant's id is an unknown one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..artifacts.base import CHECKPOINT_PREFIX, ArtifactStore
from ..artifacts.channel import FileChannel, file_channel, receive_file
from ..artifacts.workspace import CHECKPOINT_DIR
from ..audit import audit
from ..config import ADMIN_TENANT, Settings
from ..errors import (
    CheckpointAnswerRefused,
    CheckpointFailed,
    CheckpointNotFound,
    FileNotFound,
    KernelmodeError,
    PayloadTooLarge,
    StoreError,
)
from ..models import CheckpointInfo, RestoredFrom, RunResult, SkippedFile, SkippedVariable
from ..sandbox.spec import WORKSPACE_MOUNT
from ..tenants import ADMIN, Principal
from .checkpoint_files import archive, copy_in, unpack
from .kernels import Kernel
from .live import LiveSession, now
from .packages import layer_wheels
from .snapshot_call import (
    LoadAnswer,
    SaveAnswer,
    call_snapshot,
    parse_answer,
)
from .store import SessionStore

__all__ = ["CheckpointAnswerRefused", "CheckpointFailed", "CheckpointNotFound", "Checkpoints", "Restore"]

log = logging.getLogger("kernelmode.sessions")

_SkippedFiles = list[SkippedFile]  # (``list`` is a method of Checkpoints)
_INDEX_SLACK = 16 * 1024 * 1024  # the snapshot's index and headers, on top of max_bytes


def namespace_key(checkpoint_id: str) -> str:
    return f"{CHECKPOINT_PREFIX}{checkpoint_id}/namespace.kmck"


def workspace_key(checkpoint_id: str) -> str:
    return f"{CHECKPOINT_PREFIX}{checkpoint_id}/workspace.tar"


@dataclass
class Restore:
    """What a restore before a run brought back; written onto that run's result."""

    checkpoint: CheckpointInfo
    restored: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    error: str | None = None
    complete: bool = False  # all the session had: nothing lost, no run after the checkpoint

    def apply(self, result: RunResult) -> None:
        result.restored_variables = self.restored
        result.lost_variables = self.lost
        if self.error is not None:
            result.restore_error = self.error
            result.state_lost = True
            return
        age = (now() - self.checkpoint.created_at).total_seconds()
        result.restored_from = RestoredFrom(checkpoint_id=self.checkpoint.checkpoint_id, age_seconds=round(age, 3))
        if not self.complete:
            result.state_lost = True


class Checkpoints:
    """Takes, lists, restores and forgets checkpoints (``artifacts``: None without a store)."""

    def __init__(self, settings: Settings, store: SessionStore, artifacts: ArtifactStore | None,
                 scratch: Path) -> None:
        self.settings = settings
        self.cfg = settings.sessions.checkpoint
        self.store = store
        self.artifacts = artifacts
        self.scratch = scratch

    def _need_store(self) -> ArtifactStore:
        if self.artifacts is None:
            raise CheckpointFailed("checkpoints need an artifact store, and this server has none")
        return self.artifacts

    # -- lookups (tenant-checked) ------------------------------------------------------------------
    def find(self, checkpoint_id: str, principal: Principal = ADMIN) -> CheckpointInfo:
        """The checkpoint, if ``principal``'s tenant owns it (else: unknown, like a wrong id)."""
        found = self.store.checkpoint(checkpoint_id)
        if found is None or not principal.may_see(found[1]):
            raise CheckpointNotFound(f"no checkpoint {checkpoint_id!r}")
        return found[0]

    def list(self, session_id: str) -> list[CheckpointInfo]:
        return self.store.checkpoints(session_id)

    # -- take ---------------------------------------------------------------------------------------
    async def take(self, s: LiveSession, auto: bool = False) -> CheckpointInfo:
        """Save the session's variables and files (the caller holds the session's lock)."""
        info = await self.take_if_changed(s, auto, if_changed=False)
        assert info is not None
        return info

    async def take_if_changed(self, s: LiveSession, auto: bool = True, if_changed: bool = True) -> CheckpointInfo | None:
        """``take``, or None when the namespace is as at this kernel's latest checkpoint (then
        that one stands)."""
        self._need_store()
        k = s.kernel
        if not k.ready:
            raise CheckpointFailed(f"session {s.info.session_id!r} has no running kernel to checkpoint "
                                   f"(status {s.info.status}); run code first")
        started = time.monotonic()
        cid = uuid.uuid4().hex
        rel = PurePosixPath(CHECKPOINT_DIR, f"{cid}.kmck")
        channel = self._channel(s)
        unchanged = stored = recorded = False
        try:
            raw = await self._call(k, {"op": "save", "path": f"{WORKSPACE_MOUNT}/{rel}",
                                       "max_bytes": self.cfg.max_bytes, "if_changed": if_changed})
            s.last_checkpoint = time.monotonic()
            answer = parse_answer(SaveAnswer, raw)  # before anything is stored
            if answer.unchanged:  # no file written: nothing to clean up
                s.changed_since_checkpoint = False
                unchanged = True
                return None
            if answer.error is not None:
                raise CheckpointFailed(f"the kernel could not write its checkpoint: {answer.error}")
            stored = True  # from here, objects may reach the store
            size, files, tar_size, skipped_files = await self._store(s, channel, cid, rel)
            info = CheckpointInfo(
                checkpoint_id=cid, session_id=s.info.session_id, saved=list(answer.saved),
                skipped=[SkippedVariable(name=x.name, reason=x.reason) for x in answer.skipped],
                bytes=size + tar_size, workspace_files=files, skipped_files=skipped_files, created_at=now(),
                auto=auto, serialize_ms=round(answer.seconds * 1000, 3),
                duration_ms=round((time.monotonic() - started) * 1000, 3),
                packages=await asyncio.to_thread(layer_wheels, k.layer))
            if k.closed or self.store.get(s.info.session_id) is None:
                # Deleted while this was stored: its checkpoints were forgotten already, so a
                # record added now would point at objects nothing ever removes.
                raise CheckpointFailed(f"session {s.info.session_id!r} was deleted while its checkpoint was stored")
            self.store.add_checkpoint(info, s.info.tenant or ADMIN_TENANT)  # no await since the check
            recorded = True
        finally:
            if stored and not recorded:  # failed, cancelled, or the kernel died under it (a DELETE)
                await asyncio.shield(self._drop_objects(cid))
            if not unchanged:
                with contextlib.suppress(KernelmodeError):
                    await channel.delete(rel)
        s.changed_since_checkpoint = False
        await self._prune(s.info.session_id)
        audit("checkpoint", session_id=s.info.session_id, tenant=s.info.tenant, checkpoint_id=cid,
              bytes=info.bytes, saved=len(info.saved), skipped=len(info.skipped), auto=auto)
        return info

    async def _store(self, s: LiveSession, channel: FileChannel, cid: str,
                     rel: PurePosixPath) -> tuple[int, int, int, _SkippedFiles]:
        """The kernel's snapshot file, then its workspace (bounded by limits.disk_mb), through
        its channels, each copied to scratch, then stored: (snapshot bytes, files, tar bytes,
        files left out)."""
        artifacts = self._need_store()
        tar = self.scratch / f"checkpoint-{cid}.tar"
        blob: Path | None = None
        cap = self.cfg.max_bytes + _INDEX_SLACK
        try:
            try:
                blob, size, _ = await receive_file(channel, rel, cap, self.scratch)
            except FileNotFound as e:
                raise CheckpointFailed("the kernel's checkpoint file is missing or not a plain file") from e
            except PayloadTooLarge as e:
                raise CheckpointFailed(f"the checkpoint file is larger than the cap of {cap} bytes") from e
            await _put_whole(artifacts, namespace_key(cid), blob, "application/octet-stream")
            files, tar_size, skipped = await archive(channel, tar, self.scratch, s.info.limits.disk_mb << 20)
            if files:
                await _put_whole(artifacts, workspace_key(cid), tar, "application/x-tar")
            return size, files, tar_size, skipped
        except StoreError as e:
            raise CheckpointFailed(f"the checkpoint could not be stored: {e}") from e
        finally:
            if blob is not None:
                blob.unlink(missing_ok=True)
            tar.unlink(missing_ok=True)

    async def _drop_objects(self, checkpoint_id: str) -> None:
        """Remove the objects of a checkpoint no record points at (a failed or cancelled take)."""
        if self.artifacts is None:
            return
        for key in (namespace_key(checkpoint_id), workspace_key(checkpoint_id)):
            try:
                await self.artifacts.delete(key)
            except StoreError as e:
                log.warning("checkpoint %s: a leftover object: %s", checkpoint_id, e)

    # -- automatic ---------------------------------------------------------------------------------
    def after_run(self, s: LiveSession, result: RunResult) -> None:
        """After a successful run (its answer is on its way): a checkpoint in the background when
        ``auto`` is on, the run changed something and the last one is old enough."""
        if (not self.cfg.auto or self.artifacts is None or result.status != "ok" or not s.changed_since_checkpoint
                or s.auto_checkpoint is not None
                or time.monotonic() - s.last_checkpoint < self.cfg.min_interval_seconds):
            return
        s.auto_checkpoint = asyncio.create_task(self._auto(s), name=f"checkpoint-{s.info.session_id}")

    async def _auto(self, s: LiveSession) -> None:
        try:
            async with s.lock:  # after this run; the session's next run waits for it
                if s.kernel.ready and not s.kernel.state_lost and s.changed_since_checkpoint and not s.kernel.closed:
                    await self.take_if_changed(s)
        except KernelmodeError as e:
            log.warning("session %s: automatic checkpoint failed: %s", s.info.session_id, e)
        finally:
            s.auto_checkpoint = None

    # -- restore ------------------------------------------------------------------------------------
    async def before_run(self, s: LiveSession) -> Restore | None:
        """After the kernel died (and was restarted or replaced): load the latest checkpoint into
        the fresh kernel before the next run. None when there is nothing to restore."""
        k = s.kernel
        await self.reseed(s)
        if not k.restore_pending:
            return None
        k.restore_pending = False
        latest = self.store.checkpoints(s.info.session_id)
        if not latest or self.artifacts is None:
            return None
        restore = await self.restore(s, latest[0])
        if restore.complete:
            k.take_state_lost()  # all is back: the run's result need not say variables are gone
        return restore

    async def restore(self, s: LiveSession, info: CheckpointInfo) -> Restore:
        """Load ``info``'s variables into the session's (fresh, ready) kernel. A damaged or
        missing checkpoint is a Restore with ``error`` (and the kernel is left empty)."""
        out = Restore(checkpoint=info)
        skipped = [x.name for x in info.skipped]
        try:
            rel = PurePosixPath(CHECKPOINT_DIR, f"restore-{info.checkpoint_id}.kmck")
            await copy_in(self._need_store(), namespace_key(info.checkpoint_id), self._channel(s), rel)
            raw = await self._call(s.kernel, {"op": "load", "path": f"{WORKSPACE_MOUNT}/{rel}"})
            answer = parse_answer(LoadAnswer, raw)
        except (KernelmodeError, StoreError) as e:
            answer = LoadAnswer(error=str(e)[:2000])
        if answer.error is not None:
            out.error = f"checkpoint {info.checkpoint_id} could not be restored: {answer.error}"
            out.lost = info.saved + skipped
            log.warning("session %s: %s", s.info.session_id, out.error)
        else:
            out.restored = list(answer.restored)
            lost_now = [x.name for x in answer.lost]
            out.lost = skipped + lost_now
            out.complete = not out.lost and not s.changed_since_checkpoint
        audit("checkpoint_restored", session_id=s.info.session_id, tenant=s.info.tenant,
              checkpoint_id=info.checkpoint_id, restored=len(out.restored), lost=len(out.lost),
              error=out.error)
        return out

    async def start_from(self, s: LiveSession, source: CheckpointInfo) -> None:
        """A new session (a fork) takes the checkpoint's files and variables; CheckpointFailed
        if they do not come back."""
        async with s.lock:
            await self.seed_workspace(self._channel(s), source)
            restore = await self.restore(s, source)
            if restore.error is not None:
                raise CheckpointFailed(restore.error)
            s.changed_since_checkpoint = True
            channel = file_channel(s.conn, self.settings.sessions.files_timeout_seconds)
            if channel is not None:  # the seeded files are not artifacts of its first run
                await channel.scan(rebase=True)

    def _channel(self, s: LiveSession) -> FileChannel:
        channel = file_channel(s.conn, self.settings.sessions.files_timeout_seconds)
        if channel is None:
            raise CheckpointFailed(f"session {s.info.session_id!r}: the kernel's channels cannot carry files")
        return channel

    async def reseed(self, s: LiveSession) -> None:
        """A remote kernel's workspace is on its node and goes with the kernel: after a death or
        a wake, put back the latest checkpoint's files that are not there (a kernel the gateway
        restarted on the same node kept its files; those are never overwritten). A failure is
        logged: the run goes on with what the workspace has."""
        k = s.kernel
        if not k.files_pending:
            return
        k.files_pending = False
        latest = self.store.checkpoints(s.info.session_id)
        if not latest or self.artifacts is None:
            return
        try:
            await self.seed_workspace(self._channel(s), latest[0], overwrite=False)
        except KernelmodeError as e:
            log.warning("session %s: the files of checkpoint %s did not come back: %s",
                        s.info.session_id, latest[0].checkpoint_id, e)

    async def seed_workspace(self, channel: FileChannel, info: CheckpointInfo, overwrite: bool = True) -> None:
        """Fill a workspace with the checkpoint's files (a fork; a remote kernel's after a death,
        without ``overwrite``: files already there stay as they are)."""
        if not info.workspace_files:
            return
        store = self._need_store()
        tmp = self.scratch / f"seed-{uuid.uuid4().hex}.tar"

        def fetch() -> None:
            with store.reader(workspace_key(info.checkpoint_id)) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)

        try:
            await asyncio.to_thread(fetch)
            await unpack(tmp, channel, overwrite)
        except StoreError as e:
            raise CheckpointFailed(f"the files of checkpoint {info.checkpoint_id} could not be read: {e}") from e
        finally:
            tmp.unlink(missing_ok=True)

    # -- forgetting ---------------------------------------------------------------------------------
    async def forget(self, session_id: str) -> None:
        """Remove every checkpoint of the session (it is deleted)."""
        for info in self.store.checkpoints(session_id):
            await self._remove(info.checkpoint_id)

    async def _prune(self, session_id: str) -> None:
        for info in self.store.checkpoints(session_id)[self.cfg.keep:]:
            await self._remove(info.checkpoint_id)

    async def _remove(self, checkpoint_id: str) -> None:
        self.store.delete_checkpoint(checkpoint_id)
        if self.artifacts is None:
            return
        for key in (namespace_key(checkpoint_id), workspace_key(checkpoint_id)):
            try:
                await self.artifacts.delete(key)
            except StoreError as e:  # the record is gone; a leftover object is only space
                log.warning("checkpoint %s: %s", checkpoint_id, e)

    # -- the kernel side ----------------------------------------------------------------------------
    async def _call(self, k: Kernel, request: dict[str, Any]) -> dict[str, Any] | None:
        return await call_snapshot(k, request, self.cfg.timeout_seconds,
                                   self.settings.sessions.interrupt_grace_seconds)


async def _put_whole(store: ArtifactStore, key: str, path: Path, mime_type: str) -> None:
    """``put_file``, awaited to its end even when the caller is cancelled: its thread writes on
    regardless, and would otherwise land the object after the caller's cleanup removed it."""
    task = asyncio.ensure_future(store.put_file(key, path, mime_type))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await task
        raise
