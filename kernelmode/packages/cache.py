"""The wheel cache shared by all sessions: wheels named by their sha256 (checked again before
each use), and the resolutions that picked them, so a second install of the same packages for
the same kernel target needs neither pip nor the index.

Layout: ``wheels/<sha256>/<wheel file name>`` and ``resolved/<key>.json`` (the wheels one
request resolved to). Files are written to a temporary name and renamed: a crash leaves no
half file under a final name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from ..errors import PackageFetchFailed


@dataclass(frozen=True)
class CachedWheel:
    name: str  # as the wheel spells it
    version: str
    filename: str
    sha256: str
    size: int

    @property
    def key(self) -> str:
        return str(canonicalize_name(self.name))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_identity(filename: str) -> tuple[str, str]:
    """(name, version) from a wheel's file name; PackageFetchFailed for anything else."""
    try:
        name, version, _build, _tags = parse_wheel_filename(filename)
    except InvalidWheelFilename as e:
        raise PackageFetchFailed(f"the download holds a file that is not a wheel: {filename}") from e
    return str(name), str(version)


class WheelCache:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.wheels = root / "wheels"
        self.resolved = root / "resolved"
        self.tmp = root / "tmp"

    def ensure(self) -> None:
        for d in (self.wheels, self.resolved, self.tmp):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)

    def staging(self) -> Path:
        """A fresh directory on the cache's filesystem (pip downloads there)."""
        self.ensure()
        return Path(tempfile.mkdtemp(dir=self.tmp, prefix="dl-"))

    def add(self, path: Path) -> CachedWheel:
        """Move a downloaded wheel into the cache under its hash."""
        name, version = wheel_identity(path.name)
        digest = sha256_file(path)
        size = path.stat().st_size
        final = self.wheels / digest / path.name
        if not final.is_file():
            final.parent.mkdir(exist_ok=True, mode=0o700)
            os.replace(path, final)
        return CachedWheel(name, version, path.name, digest, size)

    def path(self, wheel: CachedWheel) -> Path:
        """The cached file, after checking its hash (a corrupted or swapped file is refused)."""
        p = self.wheels / wheel.sha256 / wheel.filename
        if not p.is_file() or sha256_file(p) != wheel.sha256:
            shutil.rmtree(p.parent, ignore_errors=True)
            raise PackageFetchFailed(f"the cached wheel {wheel.filename} is missing or does not match its "
                                     "sha256; it was removed, install again to fetch it anew")
        return p

    def lookup(self, key: str) -> list[CachedWheel] | None:
        try:
            data = json.loads((self.resolved / f"{key}.json").read_text())
            wheels = [CachedWheel(**w) for w in data["wheels"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not all((self.wheels / w.sha256 / w.filename).is_file() for w in wheels):
            return None
        return wheels

    def remember(self, key: str, wheels: list[CachedWheel]) -> None:
        self.ensure()
        target = self.resolved / f"{key}.json"
        with tempfile.NamedTemporaryFile("w", dir=self.resolved, delete=False) as f:
            json.dump({"wheels": [asdict(w) for w in wheels]}, f)
        os.replace(f.name, target)


def resolution_key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
