"""deploy/kubernetes/, validated offline: no cluster runs on these machines, so every object the
base and the gVisor overlay apply, and the kernel pod EG renders from the template for the
manager's real KERNEL_* values, is checked against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: an unknown field is an error) for the oldest and newest versions
the deployment claims, and for the security properties themselves: every kernel pod non-root,
read-only root filesystem, all capabilities dropped, no service-account token, seccomp, limits
from the session's; the NetworkPolicies evaluated pod to pod (tests/kubernetes_render.py).
"""

from __future__ import annotations

import copy
import ipaddress
import re
from pathlib import Path
from typing import Any

import jinja2
import kubernetes_validate
import pytest
import yaml

from kernelmode.config import load_settings
from kernelmode.gateway.launch import launch_env
from kernelmode.models import Limits
from kernelmode.sandbox.egress import CA_VARIABLES, ENV_CA, ENV_PROXY, ENV_TOKEN, remote_environment
from kernelmode.sandbox.spec import KernelParams
from tests.kubernetes_render import (
    Cluster,
    Pod,
    container_env,
    find,
    kernelspec_files,
    kubelet_env,
    kustomize,
    launcher_env,
    pod_labels,
    pod_spec,
    render_kernel_pod,
)

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# The range docs/scaling.md states: NetworkPolicy endPort and Pod Security admission are GA
# since 1.25; 1.30 is the oldest release still maintained by the big clouds as this is written.
VERSIONS = ("1.30.0", "1.37.0")
KERNEL_ID = "3f1c2b9e-6a0d-4e7b-9c1a-2d5e8f7a6b4c"
WORKLOADS = ("Deployment", "StatefulSet", "Pod")


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return kustomize(K8S / "base")


@pytest.fixture(scope="module")
def gvisor() -> list[dict[str, Any]]:
    return kustomize(K8S / "overlays" / "gvisor")


def eg_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return container_env(find(docs, "Deployment", "enterprise-gateway", "kernelmode"))


def kernel_pod(docs: list[dict[str, Any]], tenant: str | None = "team-a", limits: Limits | None = None,
               client_env: dict[str, str] | None = None) -> dict[str, Any]:
    """The pod EG would create for a kernel start by the manager: its sandbox parameters and
    checked launch parameters (kernelmode/sessions/kernels.py start_env), as they are today."""
    limits = limits or Limits()
    files, spec = kernelspec_files(docs)
    if client_env is None:
        client_env = {**KernelParams(Path("/unused"), limits, "s1").to_env(), **launch_env(tenant, limits)}
    return render_kernel_pod(files, launcher_env(spec, client_env, KERNEL_ID, eg_env(docs)))


def validate(doc: dict[str, Any]) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


# -- schemas --------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["base", "gvisor"])
def test_every_object_is_valid_for_the_stated_versions(which: str, request: pytest.FixtureRequest) -> None:
    docs = request.getfixturevalue(which)
    kinds = sorted({d["kind"] for d in docs})
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "Role", "RoleBinding",
            "ServiceAccount", "Namespace", "PodDisruptionBudget", "ResourceQuota"} <= set(kinds)
    base = request.getfixturevalue("base")
    for doc in docs:
        if which == "base" or doc not in base:  # the overlay: only what it changes or adds
            validate(doc)
    validate(kernel_pod(docs))


def example_secret() -> dict[str, Any]:
    return dict(yaml.safe_load((K8S / "secrets.example.yaml").read_text()))


def test_the_example_secret_is_valid_and_has_every_key_the_workloads_read(base: list[dict[str, Any]]) -> None:
    secret = example_secret()
    validate(secret)
    read = {(ref["name"], ref["key"]) for d in base if d["kind"] in WORKLOADS
            for c in pod_spec(d)["containers"] for e in c.get("env", [])
            for ref in [e.get("valueFrom", {}).get("secretKeyRef")] if ref}
    assert read and read <= {(secret["metadata"]["name"], k) for k in secret["stringData"]}


def test_the_validator_is_strict_so_these_checks_can_fail(base: list[dict[str, Any]]) -> None:
    """A typo'd field (readOnlyRootFileSystem) or a wrong type must fail: the check has teeth."""
    pod = kernel_pod(base)
    typo = copy.deepcopy(pod)
    typo["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(typo)
    wrong = copy.deepcopy(find(base, "NetworkPolicy", "kernels", "kernelmode-kernels"))
    wrong["spec"]["ingress"][0]["ports"][0]["endPort"] = "41000"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(wrong)


# -- the kernel pod -------------------------------------------------------------------------------

def assert_locked_down(pod: dict[str, Any]) -> None:
    spec = pod["spec"]
    sc = spec["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["runAsGroup"] != 0
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    for c in spec["containers"]:
        csc = c["securityContext"]
        assert csc["readOnlyRootFilesystem"] is True and csc["allowPrivilegeEscalation"] is False
        assert csc["capabilities"] == {"drop": ["ALL"]} and not csc.get("privileged")
        assert {"cpu", "memory"} <= set(c["resources"]["limits"])
        # Beside the two sized emptyDirs, only the egress CA bundle (read-only) when it is configured.
        writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert writable == {"/tmp", "/mnt/data"}
        assert {m["mountPath"] for m in c["volumeMounts"]} - writable <= {"/etc/kernelmode-egress-ca"}
    for v in spec["volumes"]:
        if "configMap" in v:
            assert v["configMap"]["name"] == "kernelmode-egress-ca"
            continue
        assert set(v) == {"name", "emptyDir"} and v["emptyDir"]["sizeLimit"].endswith("Mi")


@pytest.mark.parametrize("tenant, limits", [
    ("team-a", Limits()),
    (None, Limits(memory_mb=4096, disk_mb=2048)),
    ("t.prod_1", Limits(memory_mb=128, disk_mb=1)),
])
def test_kernel_pod_is_locked_down_and_sized_from_the_session(base: list[dict[str, Any]], tenant: str | None,
                                                               limits: Limits) -> None:
    pod = kernel_pod(base, tenant, limits)
    validate(pod)
    assert_locked_down(pod)
    res = pod["spec"]["containers"][0]["resources"]
    assert res["limits"]["memory"] == f"{limits.memory_mb}Mi" and res["limits"]["cpu"] == "1"
    assert res["requests"]["memory"] == f"{min(256, limits.memory_mb)}Mi" and res["requests"]["cpu"] == "0.1"
    sizes = {v["name"]: v["emptyDir"]["sizeLimit"] for v in pod["spec"]["volumes"]}
    assert sizes == {"workspace": f"{limits.disk_mb}Mi", "tmp": "256Mi"}
    assert pod["metadata"]["namespace"] == "kernelmode-kernels"
    assert pod["metadata"]["labels"]["kernel_id"] == KERNEL_ID  # what EG finds its pod by
    assert pod["metadata"]["annotations"]["kernelmode.io/tenant"] == (tenant or "kernelmode")
    assert "runtimeClassName" not in pod["spec"]
    assert {t["key"]: t["tolerationSeconds"] for t in pod["spec"]["tolerations"]} == {
        "node.kubernetes.io/not-ready": 30, "node.kubernetes.io/unreachable": 30}
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    # The launcher's arguments are expanded from env EG appends; its log stays above level 10.
    for ref in re.findall(r"\$\((\w+)\)", " ".join(pod["spec"]["containers"][0]["args"])):
        assert ref in env
    assert env["LOG_LEVEL"] == "30" and "EG_AUTH_TOKEN" not in env


def test_gvisor_overlay_runs_kernel_pods_under_gvisor(gvisor: list[dict[str, Any]]) -> None:
    pod = kernel_pod(gvisor)
    assert_locked_down(pod)
    rc = find(gvisor, "RuntimeClass", pod["spec"]["runtimeClassName"])
    assert rc["handler"] == "runsc"


def test_kernel_pod_without_valid_limits_is_never_rendered(base: list[dict[str, Any]]) -> None:
    ok = {**launch_env("team-a", Limits())}
    for broken in ({k: v for k, v in ok.items() if k != "KERNEL_MEMORY_MB"}, {**ok, "KERNEL_MEMORY_MB": "0"},
                   {**ok, "KERNEL_DISK_MB": "lots"}, {**ok, "KERNEL_CPUS": "-1"}):
        with pytest.raises(jinja2.UndefinedError, match="without_valid_limits"):
            kernel_pod(base, client_env=broken)


def test_a_client_value_cannot_add_yaml_to_the_pod(base: list[dict[str, Any]]) -> None:
    """If an unchecked value reached EG (the manager refuses it first: launch.py), the template
    still quotes it; and a client's KERNEL_* cannot change what the template fixes."""
    evil = 'x"\n  runtimeClassName: runc\nhostNetwork: true #'
    env = {**launch_env(None, Limits()), "KERNEL_USERNAME": evil, "KERNEL_UID": "0",
           "KERNEL_RUNTIME_CLASS_NAME": "runc", "KERNEL_SERVICE_ACCOUNT_NAME": "default"}
    pod = kernel_pod(base, client_env=env)
    assert pod["metadata"]["annotations"]["kernelmode.io/tenant"] == evil
    assert_locked_down(pod)
    assert "runtimeClassName" not in pod["spec"] and pod["spec"]["securityContext"]["runAsUser"] == 1000
    assert pod["spec"]["serviceAccountName"] == "kernelmode-kernel"


# -- the workloads --------------------------------------------------------------------------------

def test_every_workload_runs_non_root_read_only_without_capabilities(base: list[dict[str, Any]]) -> None:
    workloads = [d for d in base if d["kind"] in WORKLOADS]
    assert {d["metadata"]["name"] for d in workloads} == {"kernelmode", "enterprise-gateway", "minio", "postgres",
                                                          "egress-proxy"}
    for d in workloads:
        spec = pod_spec(d)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in spec["containers"]:
            csc = c["securityContext"]
            assert csc["readOnlyRootFilesystem"] and csc["allowPrivilegeEscalation"] is False
            assert csc["capabilities"] == {"drop": ["ALL"]}
        # Only EG calls the Kubernetes API.
        token = spec.get("automountServiceAccountToken", True)
        assert token is (d["metadata"]["name"] == "enterprise-gateway"), d["metadata"]["name"]


def test_eg_may_only_manage_pods_in_the_kernel_namespace(base: list[dict[str, Any]]) -> None:
    assert not [d for d in base if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = find(base, "Role", "enterprise-gateway-kernels", "kernelmode-kernels")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch", "create", "delete"]}]
    binding = find(base, "RoleBinding", "enterprise-gateway-kernels", "kernelmode-kernels")
    eg = find(base, "Deployment", "enterprise-gateway", "kernelmode")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod_spec(eg)["serviceAccountName"],
                                    "namespace": "kernelmode"}]
    _, spec = kernelspec_files(base)
    assert spec["env"]["KERNEL_NAMESPACE"] == role["metadata"]["namespace"]
    ns = find(base, "Namespace", "kernelmode-kernels")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_manager_config_loads_and_points_at_eg(base: list[dict[str, Any]], tmp_path: Path) -> None:
    cm = find(base, "ConfigMap", "kernelmode-config", "kernelmode")
    manager = find(base, "Deployment", "kernelmode", "kernelmode")
    # The Secret's values arrive as env variables (the example Secret's, as the kubelet sets
    # them); the file itself holds none.
    container = pod_spec(manager)["containers"][0]
    env = kubelet_env(container, example_secret()["stringData"], "10.244.1.7")
    (tmp_path / "kernelmode.yaml").write_text(cm["data"]["kernelmode.yaml"])
    s = load_settings(tmp_path / "kernelmode.yaml", environ=env)
    svc = find(base, "Service", "enterprise-gateway", "kernelmode")
    assert s.gateway.url == f"http://{svc['metadata']['name']}.kernelmode.svc.cluster.local:{svc['spec']['ports'][0]['port']}"
    assert s.gateway.auth_token and s.artifacts.store == "s3"
    assert s.store.url == example_secret()["stringData"]["store-url"]
    assert s.server.advertise_url == f"http://10.244.1.7:{s.server.port}"
    assert "--KernelSpecManager.whitelist=" + s.gateway.kernel_name in pod_spec(find(
        base, "Deployment", "enterprise-gateway"))["containers"][0]["command"]
    assert str(s.server.data_dir) in {m["mountPath"] for m in container["volumeMounts"]}
    assert s.server.port == container["ports"][0]["containerPort"]


def test_services_target_ports_their_pods_expose(base: list[dict[str, Any]]) -> None:
    workloads = [d for d in base if d["kind"] in WORKLOADS]
    for svc in (d for d in base if d["kind"] == "Service"):
        pods = [w for w in workloads if all(pod_labels(w).get(k) == v for k, v in svc["spec"]["selector"].items())]
        assert len(pods) == 1, svc["metadata"]["name"]
        names = {p["name"] for c in pod_spec(pods[0])["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names


# -- NetworkPolicies ------------------------------------------------------------------------------

def pods_of(docs: list[dict[str, Any]]) -> dict[str, Pod]:
    out = {d["metadata"]["name"]: Pod(d["metadata"]["name"], d["metadata"]["namespace"],
                                      tuple(pod_labels(d).items())) for d in docs if d["kind"] in WORKLOADS}
    for name, kid in (("kernel", KERNEL_ID), ("other-kernel", "0" * 8 + KERNEL_ID[8:])):
        pod = kernel_pod(docs)
        labels = {**pod["metadata"]["labels"], "kernel_id": kid}
        out[name] = Pod(name, pod["metadata"]["namespace"], tuple(labels.items()))
    manager = out["kernelmode"]
    out["manager-peer"] = Pod("manager-peer", manager.namespace, manager.labels)  # another replica
    out["outside"] = Pod("outside", None)
    out["stray"] = Pod("stray", "kernelmode-kernels", (("app", "debug"),))  # a pod not made by EG
    return out


@pytest.mark.parametrize("which", ["base", "gvisor"])
def test_network_paths_are_exactly_the_designed_ones(which: str, request: pytest.FixtureRequest) -> None:
    docs = request.getfixturevalue(which)
    net, p = Cluster.of(docs), pods_of(docs)
    eg = eg_env(docs)
    lo, hi = (int(x) for x in eg["EG_PORT_RANGE"].split(".."))
    response = int(eg["EG_RESPONSE_PORT"])
    allowed = {("enterprise-gateway", "outside", 443)}
    for m, peer in (("kernelmode", "manager-peer"), ("manager-peer", "kernelmode")):  # each replica
        allowed |= {("outside", m, 8888), (m, "enterprise-gateway", 8888), (m, "minio", 9000),
                    (m, "postgres", 5432), (m, peer, 8888)}
    for k in ("kernel", "other-kernel"):  # EG to the kernel's port range; the kernel to EG's response
        # port and to the egress proxy
        allowed |= {("enterprise-gateway", k, lo), ("enterprise-gateway", k, hi), (k, "enterprise-gateway", response),
                    (k, "egress-proxy", 3128)}
    ports = {8888, 8877, 9000, 5432, 443, 53, 22, lo, hi, lo - 1, hi + 1, 2375, 10250, 3128}
    # The egress proxy: out to the internet on any port (an allowed host may be on 8443); its
    # ipBlock's exceptions are checked by test_the_egress_proxy_reaches_no_private_range. It reads
    # the session store.
    allowed |= {("egress-proxy", "outside", port) for port in ports} | {("egress-proxy", "postgres", 5432)}
    for src in p.values():
        for dst in p.values():
            if src == dst:
                continue
            for port in ports:
                want = (src.name, dst.name, port) in allowed
                assert net.allowed(src, dst, port) is want, f"{src.name} -> {dst.name}:{port}"


def test_every_pod_is_covered_both_ways(base: list[dict[str, Any]]) -> None:
    net = Cluster.of(base)
    for pod in pods_of(base).values():
        if pod.namespace is None:
            continue
        for direction in ("Ingress", "Egress"):
            assert net.selecting(pod, direction), f"{pod.name}: no {direction} policy"
    kernel = pods_of(base)["kernel"]
    named = [pol for pol in net.selecting(kernel, "Ingress") if pol["spec"]["podSelector"]]
    assert [pol["metadata"]["name"] for pol in named] == ["kernels"]
    assert {"Ingress", "Egress"} <= set(named[0]["spec"]["policyTypes"])


# -- egress ---------------------------------------------------------------------------------------

def egress_settings(base: list[dict[str, Any]], tmp_path: Path) -> Any:
    cm = find(base, "ConfigMap", "kernelmode-config", "kernelmode")
    manager = find(base, "Deployment", "kernelmode", "kernelmode")
    env = kubelet_env(pod_spec(manager)["containers"][0], example_secret()["stringData"], "10.244.1.7")
    (tmp_path / "kernelmode.yaml").write_text(cm["data"]["kernelmode.yaml"])
    return load_settings(tmp_path / "kernelmode.yaml", environ=env).egress


def test_kernel_pods_reach_the_egress_proxy_with_their_own_token(base: list[dict[str, Any]], tmp_path: Path) -> None:
    egress = egress_settings(base, tmp_path)
    svc = find(base, "Service", "egress-proxy", "kernelmode")
    proxy = find(base, "Deployment", "egress-proxy", "kernelmode")
    # The managers' address is the Service, on the port the proxy listens on (the same file).
    assert egress.proxy_address == f"egress-proxy.kernelmode.svc.cluster.local:{svc['spec']['ports'][0]['port']}"
    assert egress.listen.rsplit(":", 1)[1] == str(pod_spec(proxy)["containers"][0]["ports"][0]["containerPort"])
    assert "/etc/kernelmode/kernelmode.yaml" in pod_spec(proxy)["containers"][0]["command"]
    # A kernel launched with a token (EgressWiring.remote_launch): its pod's HTTP_PROXY names it.
    token = "ab" * 24
    limits = Limits()
    client_env = {**KernelParams(Path("/unused"), limits, "s1").to_env(),
                  **launch_env("team-a", limits, {"KERNEL_ID": KERNEL_ID, ENV_TOKEN: token,
                                                  ENV_PROXY: egress.proxy_address})}
    pod = kernel_pod(base, client_env=client_env)
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    want = remote_environment({"KERNEL_ID": KERNEL_ID, ENV_TOKEN: token, ENV_PROXY: egress.proxy_address})
    assert want["HTTP_PROXY"] == f"http://{KERNEL_ID}:{token}@{egress.proxy_address}"
    assert {k: env.get(k) for k in want} == want
    assert_locked_down(pod)
    validate(pod)
    # Without a token (egress.proxy_address unset), no proxy variable at all.
    env = {e["name"] for e in kernel_pod(base)["spec"]["containers"][0]["env"]}
    assert not env & {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"}


def test_every_egress_proxy_replica_mounts_one_ca_from_the_secret_and_nothing_else_does(
        base: list[dict[str, Any]], tmp_path: Path) -> None:
    proxy = find(base, "Deployment", "egress-proxy", "kernelmode")
    spec, c = pod_spec(proxy), pod_spec(proxy)["containers"][0]
    manager = pod_spec(find(base, "Deployment", "kernelmode", "kernelmode"))["containers"][0]
    env = {**kubelet_env(manager, example_secret()["stringData"], "10.244.1.7"),  # the same file's needs
           **kubelet_env(c, example_secret()["stringData"], "10.244.1.8")}
    (tmp_path / "kernelmode.yaml").write_text(find(base, "ConfigMap", "kernelmode-config", "kernelmode")
                                             ["data"]["kernelmode.yaml"])
    ca_dir = load_settings(tmp_path / "kernelmode.yaml", environ=env).egress.ca_dir
    assert ca_dir is not None
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(ca_dir))
    assert mount.get("readOnly") is True
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    # ca.pem and ca-key.pem (tls.Certificates' names) from the Secret's keys, the group's only.
    assert volume["secret"]["secretName"] == "kernelmode-secrets"
    assert {i["path"]: i["key"] for i in volume["secret"]["items"]} == {"ca.pem": "egress-ca.pem",
                                                                         "ca-key.pem": "egress-ca-key.pem"}
    assert volume["secret"]["defaultMode"] & 0o007 == 0 and spec["securityContext"]["fsGroup"]
    assert {"egress-ca.pem", "egress-ca-key.pem"} <= set(example_secret()["stringData"])
    # The key is with the proxies only: no other workload mounts or reads it.
    for d in base:
        if d["kind"] in WORKLOADS and d is not proxy:
            assert "egress-ca-key.pem" not in str(pod_spec(d)), d["metadata"]["name"]


def test_kernel_pods_trust_the_egress_ca_bundle_mounted_at_remote_ca_bundle(
        base: list[dict[str, Any]], tmp_path: Path) -> None:
    egress = egress_settings(base, tmp_path)
    assert egress.remote_ca_bundle is not None
    launch = {"KERNEL_ID": KERNEL_ID, ENV_TOKEN: "cd" * 24, ENV_PROXY: str(egress.proxy_address),
              ENV_CA: egress.remote_ca_bundle}
    limits = Limits()
    client_env = {**KernelParams(Path("/unused"), limits, "s1").to_env(),
                  **launch_env("team-a", limits, {k: v for k, v in launch.items() if k != "KERNEL_ID"})}
    pod = kernel_pod(base, client_env=client_env)
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    want = remote_environment(launch)
    assert set(CA_VARIABLES) <= set(want) and {k: env.get(k) for k in want} == want
    # The file those variables name: the bundle ConfigMap, mounted read-only.
    mount = next(m for m in c["volumeMounts"] if egress.remote_ca_bundle.startswith(m["mountPath"] + "/"))
    assert mount.get("readOnly") is True
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    item = egress.remote_ca_bundle[len(mount["mountPath"]) + 1:]
    assert volume["configMap"]["name"] == "kernelmode-egress-ca"
    assert [i["path"] for i in volume["configMap"]["items"]] == [item]
    assert_locked_down(pod)
    validate(pod)
    # Without it (egress.remote_ca_bundle unset): neither the variables nor the mount.
    plain = kernel_pod(base)
    assert not {e["name"] for e in plain["spec"]["containers"][0]["env"]} & set(CA_VARIABLES)
    assert "kernelmode-egress-ca" not in str(plain["spec"]["volumes"])


def test_the_egress_proxy_reaches_no_private_range(base: list[dict[str, Any]]) -> None:
    pol = find(base, "NetworkPolicy", "egress-proxy", "kernelmode")
    blocks = [peer["ipBlock"] for rule in pol["spec"]["egress"] for peer in rule["to"] if "ipBlock" in peer]
    assert blocks

    def reachable(address: str) -> bool:
        a = ipaddress.ip_address(address)
        return any(a in ipaddress.ip_network(b["cidr"]) and not any(
            a in ipaddress.ip_network(e) for e in b.get("except", [])) for b in blocks
            if ipaddress.ip_network(b["cidr"]).version == a.version)
    for private in ("10.0.0.1", "10.96.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
                    "127.0.0.1", "fd00::1", "fe80::1", "::1"):
        assert not reachable(private), private
    assert reachable("8.8.8.8") and reachable("2001:4860:4860::8888")
    # Kernel pods: no ipBlock at all (they reach the internet only through the proxy).
    for p in (d for d in base if d["kind"] == "NetworkPolicy" and d["metadata"]["namespace"] == "kernelmode-kernels"):
        assert "ipBlock" not in str(p["spec"].get("egress", [])), p["metadata"]["name"]
