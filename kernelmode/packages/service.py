"""PackageService: one install, from request to unpacked layer, the same for every front door.

Order: parse and check what is asked (policy, tenant rate); what the kernel or the session
already has is answered ``already`` without any download; the rest is resolved by pip for the
kernel's target (or taken from a remembered resolution in the cache); the resolved set is
checked again (a denied dependency is refused); the wheels are hash-checked and unpacked into the
session's layer. Every install, refused or not, is one ``package_install`` audit line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
import weakref
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..audit import audit
from ..config import Settings
from ..errors import KernelmodeError, PackageFetchFailed, PackageRefused
from ..models import PackageRef, PackagesResult
from .cache import CachedWheel, WheelCache, resolution_key
from .fetch import FetchOptions, download
from .layer import PackageLayer
from .policy import PackagePolicy, TenantRate, parse_requirement
from .target import KernelTarget, probe

KERNEL_RULE = "kernel packages are never replaced"
MAX_DOWNLOADS = 4  # pip processes at once on the host, all sessions together (the rest queue)


class PackageService:
    def __init__(self, settings: Settings, data_dir: Path, sandbox: str) -> None:
        cfg = settings.packages
        self.settings = settings
        self.sandbox = sandbox
        self.policy = PackagePolicy.from_lists(cfg.allow, cfg.deny)
        self.rate = TenantRate(cfg.installs_per_minute)
        self.cache = WheelCache(cfg.cache_dir or data_dir / "package-cache")
        self.layers_root = data_dir / "packages"
        self.options = FetchOptions(cfg.index_url, tuple(cfg.extra_index_urls),
                                    cfg.max_download_mb * 1024 * 1024, cfg.timeout_seconds)
        self._target: KernelTarget | None = None
        self._target_lock = asyncio.Lock()
        self._downloads = asyncio.Semaphore(MAX_DOWNLOADS)
        # One install at a time per layer; a lock lives while an install holds or awaits it.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def layer(self, key: str) -> PackageLayer:
        """The layer of the workspace named ``key`` (a session keeps it when its kernel is replaced)."""
        return PackageLayer(self.layers_root / key)

    def sweep(self, keep: set[str]) -> None:
        """Remove the layers of workspaces that are gone (a previous run's pool, ...)."""
        if self.layers_root.is_dir():
            for d in self.layers_root.iterdir():
                if d.name not in keep:
                    shutil.rmtree(d, ignore_errors=True)

    async def target(self) -> KernelTarget:
        async with self._target_lock:
            if self._target is None:
                self._target = await probe(self.settings, self.sandbox)
            return self._target

    async def install(self, layer: PackageLayer, requirements: list[str], *, session_id: str,
                      tenant: str | None, source: str) -> PackagesResult:
        """Install ``requirements`` into ``layer``; raise PackageRefused, NoWheel, ... (audited)."""
        started = time.monotonic()
        fields: dict[str, object] = {"session_id": session_id, "tenant": tenant, "source": source,
                                     "requested": requirements[:100]}
        try:
            lock = self._locks.get(str(layer.root)) or self._locks.setdefault(str(layer.root), asyncio.Lock())
            async with lock:
                try:
                    result = await self._install(layer, requirements, tenant)
                except OSError as e:  # the cache or the layer's disk (full, gone): not a 500
                    raise PackageFetchFailed(f"the package cache or the session's layer failed: {e}") from e
        except KernelmodeError as e:
            audit("package_install", **fields, ok=False, code=e.code, error=e.message[:500])
            raise
        result.duration_ms = round((time.monotonic() - started) * 1000, 3)
        audit("package_install", **fields, ok=True,
              installed=[f"{p.name}=={p.version}" for p in result.installed],
              already=[f"{p.name}=={p.version}" for p in result.already], duration_ms=result.duration_ms)
        return result

    async def _install(self, layer: PackageLayer, requirements: list[str], tenant: str | None) -> PackagesResult:
        reqs = _dedupe([parse_requirement(r) for r in requirements])
        for req in reqs:
            self.policy.check(req.name)
        self.rate.take(tenant or "admin")
        target = await self.target()
        present = await asyncio.to_thread(layer.installed)
        result = PackagesResult()
        pending: list[Requirement] = []
        for req in reqs:
            key = str(canonicalize_name(req.name))
            own = target.dists.get(key)
            if own is not None and not req.specifier.contains(own[1], prereleases=True):
                raise PackageRefused(f"{req} would replace the kernel's own {own[0]} {own[1]} (rule: "
                                     f"{KERNEL_RULE}; the kernel needs it)", details={"rule": "kernel_packages",
                                                                                      "package": own[0]})
            have = own or present.get(key)
            if have is not None and not req.extras and req.specifier.contains(have[1], prereleases=True):
                result.already.append(PackageRef(name=have[0], version=have[1]))
            else:
                pending.append(req)
        if not pending:
            return result
        wheels = await self._resolve(pending, target, present)
        asked = {str(canonicalize_name(r.name)) for r in pending}
        todo: list[CachedWheel] = []
        for w in wheels:
            key = w.key
            self.policy.check(w.name, w.version, "" if key in asked else " (a dependency)")
            own = target.dists.get(key) or present.get(key)
            if own is not None and _same(own[1], w.version):
                if key in asked:
                    result.already.append(PackageRef(name=own[0], version=own[1]))
                continue
            if own is not None:  # the constraints make this impossible; never trust it blindly
                raise PackageRefused(f"{w.name} {w.version} would replace {own[0]} {own[1]} (rule: {KERNEL_RULE})",
                                     details={"rule": "kernel_packages", "package": own[0]})
            todo.append(w)
        cap = self.options.max_bytes * 10  # unpacked size: wheels compress about 3-5x
        for w in todo:
            path = await asyncio.to_thread(self.cache.path, w)
            await asyncio.to_thread(layer.unpack, path, cap)
            await asyncio.to_thread(layer.record, dataclasses.asdict(w))
            result.installed.append(PackageRef(name=w.name, version=w.version))
        return result

    async def copy_in(self, layer: PackageLayer, wheels: list[CachedWheel], *, session_id: str,
                      tenant: str | None, source: str) -> PackagesResult:
        """Unpack into ``layer`` the wheels another session's layer holds (a fork, from its
        checkpoint's record): the same files from the cache, hash-checked, with the policy asked
        again; no resolution, no index. A wheel the cache no longer has is installed by its pin."""
        started = time.monotonic()
        fields: dict[str, object] = {"session_id": session_id, "tenant": tenant, "source": source,
                                     "requested": [f"{w.name}=={w.version}" for w in wheels][:100]}
        result = PackagesResult()
        try:
            lock = self._locks.get(str(layer.root)) or self._locks.setdefault(str(layer.root), asyncio.Lock())
            async with lock:
                missing: list[str] = []
                for w in wheels:
                    self.policy.check(w.name, w.version)
                present = await asyncio.to_thread(layer.installed)
                for w in wheels:
                    if w.key in present:  # the new session asked for its own version: it stays
                        result.already.append(PackageRef(name=present[w.key][0], version=present[w.key][1]))
                        continue
                    try:
                        path = await asyncio.to_thread(self.cache.path, w)
                    except PackageFetchFailed:
                        missing.append(f"{w.name}=={w.version}")
                        continue
                    await asyncio.to_thread(layer.unpack, path, self.options.max_bytes * 10)
                    await asyncio.to_thread(layer.record, dataclasses.asdict(w))
                    result.installed.append(PackageRef(name=w.name, version=w.version))
                if missing:
                    again = await self._install(layer, missing, tenant)
                    result.installed += again.installed
                    result.already += again.already
        except OSError as e:
            audit("package_install", **fields, ok=False, code="package_fetch_failed", error=str(e)[:500])
            raise PackageFetchFailed(f"the package cache or the session's layer failed: {e}") from e
        except KernelmodeError as e:
            audit("package_install", **fields, ok=False, code=e.code, error=e.message[:500])
            raise
        result.duration_ms = round((time.monotonic() - started) * 1000, 3)
        audit("package_install", **fields, ok=True, installed=[f"{p.name}=={p.version}" for p in result.installed],
              already=[f"{p.name}=={p.version}" for p in result.already], duration_ms=result.duration_ms)
        return result

    async def _resolve(self, pending: list[Requirement], target: KernelTarget,
                       present: dict[str, tuple[str, str]]) -> list[CachedWheel]:
        """The wheels ``pending`` resolves to: remembered, or downloaded now.

        A resolution is remembered for the kernel's own packages (the key); it is reused in a
        session only if it agrees with what that session already has, else pip resolves anew
        with the session's packages pinned too."""
        own = sorted({f"{n}=={v}" for n, v in target.dists.values() if _valid(v)})
        key = resolution_key(sorted(str(r) for r in pending), target.key(), self.options.index_url,
                             list(self.options.extra_index_urls), own)
        cached = await asyncio.to_thread(self.cache.lookup, key)
        if cached is not None and all(present.get(w.key, (w.name, w.version))[1] == w.version for w in cached):
            return cached
        pins = sorted({*own, *(f"{n}=={v}" for n, v in present.values() if _valid(v))})
        staging = await asyncio.to_thread(self.cache.staging)
        try:
            constraints = staging / "constraints.txt"
            constraints.write_text("\n".join(pins) + "\n")
            dest = staging / "wheels"
            dest.mkdir()
            async with self._downloads:
                files = await download(dest, [str(r) for r in pending], target, constraints, self.options)
            wheels = [await asyncio.to_thread(self.cache.add, f) for f in files]
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)
        # Valid against the kernel's packages whatever the session had (its pins only narrowed it).
        await asyncio.to_thread(self.cache.remember, key, wheels)
        return wheels


def _dedupe(reqs: list[Requirement]) -> list[Requirement]:
    seen: dict[str, Requirement] = {}
    for r in reqs:
        seen.setdefault(f"{canonicalize_name(r.name)}{sorted(r.extras)}{r.specifier}", r)
    return list(seen.values())


def _valid(version: str) -> bool:
    try:
        Version(version)
    except InvalidVersion:
        return False
    return True


def _same(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b
