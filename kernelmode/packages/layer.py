"""A session's package layer: a host directory of unpacked wheels that the sandbox mounts
read-only (``PACKAGES_MOUNT`` in sandbox/spec.py) and the preamble puts at the END of
``sys.path``, after the kernel's own site-packages.

Unpacking a wheel is reading a zip archive: nothing in it runs. Every member name is checked
(relative, no ``..``, no links), sizes are capped (a zip bomb stops early), and each wheel is
unpacked into a staging directory beside the layer, then moved in entry by entry, so the kernel
never imports a half-written package. ``*.data/purelib`` and ``platlib`` go to the top, like pip;
``scripts``, ``headers`` and ``data`` are not installed (a sandbox runs no console scripts).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath

from packaging.utils import canonicalize_name

from ..errors import PackageRefused

SITE = "site"  # the mounted directory inside a layer's root
MANIFEST = "wheels.json"  # beside SITE, never mounted: the host's record of the cached wheels unpacked


class PackageLayer:
    """The unpacked wheels of one session (its workspace's name keys it, so a replaced kernel
    keeps the session's packages)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.site = root / SITE

    def create(self) -> None:
        self.root.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
        self.site.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        os.chmod(self.site, 0o755)

    def destroy(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def installed(self) -> dict[str, tuple[str, str]]:
        """Normalized name -> (name, version) of the distributions in the layer."""
        out: dict[str, tuple[str, str]] = {}
        if not self.site.is_dir():
            return out
        for info in self.site.glob("*.dist-info"):
            try:
                meta = HeaderParser().parsestr((info / "METADATA").read_text("utf-8", "replace"))
            except OSError:
                continue
            name, version = meta.get("Name"), meta.get("Version")
            if name and version:
                out[str(canonicalize_name(name))] = (name, version)
        return out

    def wheels(self) -> list[dict[str, object]]:
        """The cache's wheels unpacked here (name, version, filename, sha256, size): what a
        checkpoint records, so that a fork unpacks the very same files."""
        try:
            data = json.loads((self.root / MANIFEST).read_text())
        except (OSError, ValueError):
            return []
        wheels = data.get("wheels") if isinstance(data, dict) else None
        return [w for w in wheels if isinstance(w, dict)] if isinstance(wheels, list) else []

    def record(self, wheel: dict[str, object]) -> None:
        """Note one unpacked wheel (one entry per distribution; written whole, then renamed)."""
        key = canonicalize_name(str(wheel["name"]))
        kept = [w for w in self.wheels() if canonicalize_name(str(w.get("name", ""))) != key]
        tmp = self.root / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"wheels": [*kept, wheel]}))
        os.replace(tmp, self.root / MANIFEST)

    def unpack(self, wheel: Path, max_bytes: int) -> None:
        """Unpack one wheel into the layer (PackageRefused for an archive that is not sane)."""
        stage = Path(tempfile.mkdtemp(dir=self.root, prefix=".staging-"))
        try:
            with zipfile.ZipFile(wheel) as zf:
                total = 0
                for member in zf.infolist():
                    rel = _member_path(member, wheel.name)
                    if rel is None:
                        continue
                    total += member.file_size
                    if total > max_bytes:
                        raise PackageRefused(f"{wheel.name} unpacks to more than {max_bytes // (1024 * 1024)} MB",
                                             details={"rule": "max_download_mb"})
                    target = stage.joinpath(*rel.parts)
                    if member.is_dir():
                        target.mkdir(parents=True, exist_ok=True)
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(member) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                    executable = (member.external_attr >> 16) & 0o111
                    os.chmod(target, 0o755 if executable else 0o644)
            for info in stage.glob("*.dist-info"):
                (info / "INSTALLER").write_text("kernelmode\n")
            _open_dirs(stage)
            for entry in sorted(stage.iterdir()):
                _merge(entry, self.site / entry.name)
        except (zipfile.BadZipFile, OSError) as e:
            raise PackageRefused(f"{wheel.name} is not a readable wheel: {e}",
                                 details={"rule": "wheel_format"}) from e
        finally:
            shutil.rmtree(stage, ignore_errors=True)


def _member_path(member: zipfile.ZipInfo, wheel: str) -> PurePosixPath | None:
    """Where a member goes in the layer (None: not installed); refuses unsafe names."""
    name = member.filename
    mode = member.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise PackageRefused(f"{wheel} holds a symbolic link ({name}): refused", details={"rule": "wheel_format"})
    path = PurePosixPath(name)
    if "\\" in name or path.is_absolute() or any(p in ("..", "") for p in path.parts) or "\x00" in name:
        raise PackageRefused(f"{wheel} holds an unsafe path ({name!r}): refused", details={"rule": "wheel_format"})
    parts = path.parts
    if parts[0].endswith(".data") and len(parts) > 1:
        if parts[1] in ("purelib", "platlib") and len(parts) > 2:
            return PurePosixPath(*parts[2:])
        return None  # scripts, headers, data
    return path


def _open_dirs(root: Path) -> None:
    for dirpath, _dirs, _files in os.walk(root):
        os.chmod(dirpath, 0o755)


def _merge(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; directories that both have (namespace packages) are merged."""
    if dst.is_dir() and not dst.is_symlink() and src.is_dir():
        for child in src.iterdir():
            _merge(child, dst / child.name)
        return
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)
    os.replace(src, dst)
