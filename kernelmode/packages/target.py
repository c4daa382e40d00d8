"""What the wheels must fit: the KERNEL's interpreter and platform (never the host's), and the
distributions the kernel environment already has.

Found once per manager by running a stdlib-only probe with the kernel's own Python: the kernel
venv's interpreter for bubblewrap and ``none``, a throw-away container of the kernel image
(``--network none``, read-only) for Docker. The probe reads metadata only; no downloaded package
is involved.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import dataclass
from typing import Any

from packaging.utils import canonicalize_name

from ..config import Settings
from ..errors import PackageFetchFailed

PROBE = r"""
import importlib.metadata as md, json, os, platform, sys, sysconfig
machine = platform.machine()
glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
plats = []
if glibc.startswith("glibc "):
    major, minor = (int(x) for x in glibc.split()[1].split(".")[:2])
    plats += ["manylinux_%d_%d_%s" % (major, m, machine) for m in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    plats += ["%s_%s" % (legacy[m], machine) for m in (17, 12, 5) if m <= minor]
plats.append(sysconfig.get_platform().replace("-", "_").replace(".", "_"))
dists = {}
for d in md.distributions():
    name = d.metadata["Name"]
    if name:
        dists[name] = d.version
print(json.dumps({"python": "%d.%d" % sys.version_info[:2],
                  "implementation": sys.implementation.name,
                  "abi": "cp%d%d" % sys.version_info[:2], "platforms": plats, "dists": dists}))
"""
PROBE_TIMEOUT = 120.0


@dataclass(frozen=True)
class KernelTarget:
    python: str  # "3.11"
    implementation: str  # "cp"
    abi: str  # "cp311"
    platforms: tuple[str, ...]  # most specific first
    dists: dict[str, tuple[str, str]]  # normalized name -> (name, version)

    @classmethod
    def from_probe(cls, data: dict[str, Any]) -> KernelTarget:
        impl = "cp" if data["implementation"] == "cpython" else str(data["implementation"])
        dists = {str(canonicalize_name(n)): (str(n), str(v)) for n, v in dict(data["dists"]).items()}
        return cls(str(data["python"]), impl, str(data["abi"]), tuple(data["platforms"]), dists)

    def pip_args(self) -> list[str]:
        args = ["--only-binary", ":all:", "--python-version", self.python,
                "--implementation", self.implementation, "--abi", self.abi, "--abi", "abi3",
                "--abi", "none"]
        for p in self.platforms:
            args += ["--platform", p]
        return args

    def describe(self) -> str:
        return f"CPython {self.python} ({self.abi}, {self.platforms[0] if self.platforms else '?'})"

    def key(self) -> str:
        return json.dumps([self.python, self.implementation, self.abi, list(self.platforms)])


def _probe_local(python: str) -> dict[str, Any]:
    proc = subprocess.run([python, "-I", "-c", PROBE], capture_output=True, text=True,
                          timeout=PROBE_TIMEOUT, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    if proc.returncode != 0:
        raise PackageFetchFailed(f"could not read the kernel's interpreter ({python}): "
                                 f"{proc.stderr.strip()[-500:]}")
    return dict(json.loads(proc.stdout))


def _probe_docker(image: str) -> dict[str, Any]:
    import docker
    from docker.errors import DockerException

    try:
        out = docker.from_env(timeout=60).containers.run(
            image, ["python", "-I", "-c", PROBE], network_mode="none", read_only=True,
            cap_drop=["ALL"], security_opt=["no-new-privileges"], user="65534:65534",
            remove=True, environment={"HOME": "/tmp"}, tmpfs={"/tmp": "size=16m"})
    except DockerException as e:
        raise PackageFetchFailed(f"could not read the kernel image's interpreter ({image}): {e}") from e
    return dict(json.loads(out))


async def probe(settings: Settings, sandbox: str) -> KernelTarget:
    """The kernel's target, read with its own interpreter (off the event loop)."""
    try:
        if sandbox == "docker":
            data = await asyncio.to_thread(_probe_docker, settings.sandbox.docker_image)
        else:
            data = await asyncio.to_thread(_probe_local, str(settings.sandbox.kernel_python))
        return KernelTarget.from_probe(data)
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
        raise PackageFetchFailed(f"could not read the kernel's interpreter: {e}") from e
