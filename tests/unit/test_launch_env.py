"""KERNEL_* launch parameters: refused before they leave the manager unless strictly safe."""

from __future__ import annotations

import pytest

from kernelmode.errors import InvalidRequest
from kernelmode.gateway.launch import DEFAULT_USERNAME, checked, launch_env
from kernelmode.models import Limits

INJECTIONS = ["a$(id)b", "a`id`b", "x'y", 'x"y', "a\nb", "a;rm -rf /", "a b", "-rf", ".hidden",
              "${KERNEL_X}", "a|b", "a&b", "a>b", "{{x}}", "", "x" * 64, "é"]


@pytest.mark.parametrize("value", INJECTIONS)
def test_injection_strings_are_refused(value: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        checked("KERNEL_USERNAME", value)
    assert e.value.code == "invalid_request" and "KERNEL_USERNAME" in e.value.message


@pytest.mark.parametrize("tenant", INJECTIONS[:-3])
def test_a_tenant_name_that_would_inject_never_reaches_the_env(tenant: str) -> None:
    if not tenant:
        assert launch_env(tenant, Limits())["KERNEL_USERNAME"] == DEFAULT_USERNAME
        return
    with pytest.raises(InvalidRequest):
        launch_env(tenant, Limits())


@pytest.mark.parametrize("name", ["KERNEL_X;Y", "PATH", "KERNEL_", "kernel_username", "KERNEL_A B"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidRequest):
        checked(name, "ok")


def test_safe_values_pass_unchanged() -> None:
    env = launch_env("team-a.prod_1", Limits(memory_mb=512), {"KERNEL_NAMESPACE": "kernels"})
    assert env == {"KERNEL_USERNAME": "team-a.prod_1", "KERNEL_MEMORY_MB": "512", "KERNEL_PIDS": "128",
                   "KERNEL_DISK_MB": "1024", "KERNEL_CPU_SECONDS": "600", "KERNEL_OPEN_FILES": "1024",
                   "KERNEL_NAMESPACE": "kernels"}


def test_a_kernelmode_gateway_reads_the_limits_a_remote_start_sends() -> None:
    """A manager with gateway.url sends plain checked numbers, no JSON and no host path; the
    provisioner of a kernelmode gateway rebuilds the same limits and makes its own workspace."""
    from pathlib import Path

    from kernelmode.sandbox.spec import ENV_LIMITS, ENV_WORKSPACE, KernelParams

    limits = Limits(memory_mb=512, pids=64, disk_mb=20, cpu_seconds=30, open_files=256)
    env = launch_env("t1", limits, {"KERNEL_ID": "k1"})
    assert ENV_LIMITS not in env and ENV_WORKSPACE not in env
    assert all(checked(k, v) == v for k, v in env.items())
    params = KernelParams.pop_from_env(dict(env), Limits(), Path("/own/k1"))
    assert params is not None and params.limits == limits and params.workspace == Path("/own/k1")
    with pytest.raises(ValueError):  # a value that is no limit fails the start
        KernelParams.pop_from_env({**env, "KERNEL_PIDS": "1"}, Limits(), Path("/own/k1"))


def test_the_egress_proxy_address_passes_and_nothing_else_with_a_colon() -> None:
    assert checked("KERNEL_KM_EGRESS_PROXY", "egress-proxy.kernelmode.svc:3128") == "egress-proxy.kernelmode.svc:3128"
    for bad in ("a:3128;rm", "a:b", "host:3128\n", "-x:1", "a:3128:1", "$(id):1"):
        with pytest.raises(InvalidRequest):
            checked("KERNEL_KM_EGRESS_PROXY", bad)
    with pytest.raises(InvalidRequest):  # only that name takes host:port
        checked("KERNEL_USERNAME", "a:3128")
