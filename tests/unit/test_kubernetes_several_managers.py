"""deploy/kubernetes/ with several managers, validated offline (docs/scaling.md "Several
managers"): the manager Deployment runs more than one replica and rolls without losing capacity
(its grace period covers preStop, the drain and the stop), a
PodDisruptionBudget lets a drain take one replica at a time, replicas spread over nodes, readiness
is the manager's own readiness route, the store's URL comes from the Secret and each pod
advertises its own address, and only managers reach PostgreSQL.

Each property is a ``check_*`` function run on the real render; ``test_each_check_fails_on_a_broken_manifest``
runs it again on a copy broken in the way it guards against, so that none passes vacuously.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict

from kernelmode.api.handlers import HealthHandler, ReadyHandler, routes
from kernelmode.config import ServerSettings
from tests.kubernetes_render import (
    Cluster,
    Pod,
    find,
    kubelet_env,
    kustomize,
    pod_labels,
    pod_spec,
    selects,
)
from tests.unit.test_kubernetes_manifests import K8S, WORKLOADS, example_secret, pods_of

Docs = list[dict[str, Any]]
# The components whose pods may open connections to PostgreSQL (the egress proxy joins them when
# it runs as a Deployment of its own that reads the store: networkpolicies.yaml says where).
STORE_CLIENTS = {"manager", "egress-proxy"}


@pytest.fixture(scope="module")
def base() -> Docs:
    return kustomize(K8S / "base")


def manager(docs: Docs) -> dict[str, Any]:
    return find(docs, "Deployment", "kernelmode", "kernelmode")


def container(doc: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = pod_spec(doc)["containers"][0]
    return c


def env_entry(c: dict[str, Any], name: str) -> dict[str, Any]:
    hits = [e for e in c.get("env", []) if e["name"] == name]
    assert len(hits) == 1, f"env {name}: {len(hits)} entries"
    return dict(hits[0])


def scaled(value: int | str, total: int, round_up: bool) -> int:
    """An IntOrString of a PDB or a rollout (``1`` or ``"25%"``) against ``total`` pods."""
    if isinstance(value, int):
        return value
    percent = int(value.rstrip("%")) * total
    return -(-percent // 100) if round_up else percent // 100


# -- the checks -------------------------------------------------------------------------------------

def check_replicas_and_rollout(docs: Docs) -> None:
    """Several replicas; a rollout adds one new pod before stopping an old one; no pod-bound
    volume (a PVC would pin the store to one pod); time to stop gracefully after preStop."""
    d = manager(docs)
    replicas = d["spec"]["replicas"]
    assert replicas >= 2
    strategy = d["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert scaled(strategy["rollingUpdate"]["maxUnavailable"], replicas, round_up=False) == 0
    assert scaled(strategy["rollingUpdate"]["maxSurge"], replicas, round_up=True) >= 1
    spec = pod_spec(d)
    assert not [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert not [o for o in docs if o["kind"] == "PersistentVolumeClaim"
                and o["metadata"]["labels"].get("app.kubernetes.io/component") == "manager"]
    pre_stop = container(d)["lifecycle"]["preStop"]["sleep"]["seconds"]
    # SIGTERM comes after preStop; the drain (runs in flight finish) and the stop after it must
    # end before the kubelet's SIGKILL.
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain_seconds(docs) + 30


def drain_seconds(docs: Docs) -> float:
    """The managers' ``server.drain_seconds``, from their ConfigMap (else the setting's default)."""
    config = yaml.safe_load(find(docs, "ConfigMap", "kernelmode-config", "kernelmode")["data"]["kernelmode.yaml"])
    given = (config.get("server") or {}).get("drain_seconds")
    return float(given if given is not None else ServerSettings().drain_seconds)


def check_disruption_budget(docs: Docs) -> None:
    """Exactly one PDB covers the managers and only them; it allows one eviction at a time and
    keeps at least one replica serving."""
    d = manager(docs)
    replicas = d["spec"]["replicas"]
    labels = pod_labels(d)
    pdbs = [p for p in docs if p["kind"] == "PodDisruptionBudget" and selects(p["spec"]["selector"], labels)
            and p["metadata"]["namespace"] == d["metadata"]["namespace"]]
    assert len(pdbs) == 1, f"{len(pdbs)} PodDisruptionBudgets select the managers"
    pdb = pdbs[0]["spec"]
    others = [w for w in docs if w["kind"] in WORKLOADS and w is not d]
    assert not [w["metadata"]["name"] for w in others if selects(pdb["selector"], pod_labels(w))]
    if "maxUnavailable" in pdb:
        allowed = scaled(pdb["maxUnavailable"], replicas, round_up=True)
    else:
        allowed = replicas - scaled(pdb["minAvailable"], replicas, round_up=True)
    assert 1 <= allowed < replicas, f"{allowed} of {replicas} managers may be evicted at once"


def check_spread_over_nodes(docs: Docs) -> None:
    """The scheduler must not put the replicas on one node (one node's loss would be all)."""
    d = manager(docs)
    labels = pod_labels(d)
    spec = pod_spec(d)
    spread = [c for c in spec.get("topologySpreadConstraints", [])
              if c["topologyKey"] == "kubernetes.io/hostname" and c["whenUnsatisfiable"] == "DoNotSchedule"
              and c["maxSkew"] == 1 and selects(c["labelSelector"], labels)]
    anti = [t for t in spec.get("affinity", {}).get("podAntiAffinity", {})
            .get("requiredDuringSchedulingIgnoredDuringExecution", [])
            if t["topologyKey"] == "kubernetes.io/hostname" and selects(t["labelSelector"], labels)]
    assert spread or anti


def handler_of(path: str) -> type:
    hits = [h for pattern, h in routes if re.fullmatch(pattern, path)]
    assert len(hits) == 1, f"{path}: {len(hits)} routes of the manager answer it"
    return hits[0]


def check_probes(docs: Docs) -> None:
    """Readiness asks the manager's readiness route, liveness its health route, on its port."""
    c = container(manager(docs))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    ready, live = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
    assert handler_of(ready["path"]) is ReadyHandler
    assert handler_of(live["path"]) is HealthHandler
    assert ready["port"] in ports and live["port"] in ports


def check_store_and_advertise_url(docs: Docs) -> None:
    """store.url only from the Secret (it holds the password); server.advertise_url each pod's
    own address on the API port, as the kubelet expands it."""
    d = manager(docs)
    c = container(d)
    ref = env_entry(c, "KERNELMODE_STORE__URL").get("valueFrom", {}).get("secretKeyRef")
    assert ref == {"name": "kernelmode-secrets", "key": "store-url"}
    config = yaml.safe_load(find(docs, "ConfigMap", "kernelmode-config", "kernelmode")["data"]["kernelmode.yaml"])
    assert "url" not in (config.get("store") or {})
    port = c["ports"][0]["containerPort"]
    secret = example_secret()["stringData"]
    for ip in ("10.244.1.7", "10.244.2.9"):
        assert kubelet_env(c, secret, ip)["KERNELMODE_SERVER__ADVERTISE_URL"] == f"http://{ip}:{port}"


def store_client(pod: Pod) -> bool:
    return pod.namespace == "kernelmode" and pod.label_map.get("app.kubernetes.io/component") in STORE_CLIENTS


def check_store_paths(docs: Docs) -> None:
    """PostgreSQL accepts the managers (every replica) and nothing else; managers reach each other
    on the API port; kernels reach neither managers nor PostgreSQL."""
    net, p = Cluster.of(docs), pods_of(docs)
    managers = ("kernelmode", "manager-peer")
    pg = p["postgres"]
    for name, pod in p.items():
        if name != "postgres":
            assert net.allowed(pod, pg, 5432) is store_client(pod), f"{name} -> postgres:5432"
    assert all(net.allowed(p[m], pg, 5432) for m in managers)
    assert net.allowed(p["kernelmode"], p["manager-peer"], 8888)
    assert net.allowed(p["manager-peer"], p["kernelmode"], 8888)
    for kernel in ("kernel", "other-kernel", "stray"):
        for dst in (*managers, "postgres"):
            for port in (8888, 5432):
                assert not net.allowed(p[kernel], p[dst], port), f"{kernel} -> {dst}:{port}"
    # And by its own policy, not only because every other pod's egress is closed: each peer its
    # ingress names is a pod selector of this namespace that matches store clients only.
    others = [pod for pod in p.values() if pod.namespace and not store_client(pod)]
    for pol in net.selecting(pg, "Ingress"):
        for rule in pol["spec"].get("ingress", []):
            assert rule.get("from"), f"{pol['metadata']['name']}: an ingress rule open to every source"
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, f"{pol['metadata']['name']}: {peer}"
                assert not [o.name for o in others if selects(peer["podSelector"], o.label_map)]


def check_reference_postgres(docs: Docs) -> None:
    """The example store-url names the reference PostgreSQL (its Service, user, database and the
    Secret's password), whose data directory is on its volume below the mount point."""
    sts = find(docs, "StatefulSet", "postgres", "kernelmode")
    c = container(sts)
    svc = find(docs, "Service", "postgres", "kernelmode")
    secret = example_secret()["stringData"]
    url = conninfo_to_dict(secret["store-url"])
    env = kubelet_env(c, secret, "10.244.3.3")
    assert url["host"] == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert int(url["port"]) == svc["spec"]["ports"][0]["port"]
    assert (url["user"], url["dbname"], url["password"]) == (
        env["POSTGRES_USER"], env["POSTGRES_DB"], env["POSTGRES_PASSWORD"])
    assert env_entry(c, "POSTGRES_PASSWORD")["valueFrom"]["secretKeyRef"]["key"] == "postgres-password"
    data = [m["mountPath"] for m in c["volumeMounts"]
            if m["name"] in {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}]
    assert len(data) == 1 and env["PGDATA"].startswith(data[0].rstrip("/") + "/")
    # Everything else it writes is an emptyDir: the root filesystem is read-only.
    writable = {m["mountPath"] for m in c["volumeMounts"]} - set(data)
    assert writable == {"/var/run/postgresql", "/tmp", "/dev/shm"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


CHECKS = (check_replicas_and_rollout, check_disruption_budget, check_spread_over_nodes, check_probes,
          check_store_and_advertise_url, check_store_paths, check_reference_postgres)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_deployment_runs_several_managers(base: Docs, check: Callable[[Docs], None]) -> None:
    check(base)


# -- the checks have teeth --------------------------------------------------------------------------

def _mgr(docs: Docs) -> dict[str, Any]:
    return container(manager(docs))


def _policy(docs: Docs, name: str) -> dict[str, Any]:
    return find(docs, "NetworkPolicy", name, "kernelmode")


def _drop(docs: Docs, kind: str, name: str) -> None:
    docs.remove(find(docs, kind, name, "kernelmode"))


def _set_drain(docs: Docs, seconds: float | None) -> None:
    """The ConfigMap's ``server.drain_seconds`` (None: not given, the default)."""
    data = find(docs, "ConfigMap", "kernelmode-config", "kernelmode")["data"]
    config = yaml.safe_load(data["kernelmode.yaml"])
    config["server"].pop("drain_seconds", None)
    if seconds is not None:
        config["server"]["drain_seconds"] = seconds
    data["kernelmode.yaml"] = yaml.safe_dump(config)


def _env_first(docs: Docs, name: str) -> None:
    """Move env ``name`` to the end of the manager's env list."""
    env = _mgr(docs)["env"]
    env.append(env.pop(next(i for i, e in enumerate(env) if e["name"] == name)))


BREAKAGES: dict[str, tuple[Callable[[Docs], None], Callable[[Docs], None]]] = {
    "one replica": (lambda d: manager(d)["spec"].update(replicas=1), check_replicas_and_rollout),
    "Recreate": (lambda d: manager(d)["spec"].update(strategy={"type": "Recreate"}), check_replicas_and_rollout),
    "maxUnavailable 1": (lambda d: manager(d)["spec"]["strategy"]["rollingUpdate"].update(maxUnavailable=1),
                         check_replicas_and_rollout),
    "a PVC again": (lambda d: pod_spec(manager(d))["volumes"].append(
        {"name": "store", "persistentVolumeClaim": {"claimName": "kernelmode-data"}}), check_replicas_and_rollout),
    "grace shorter than preStop": (lambda d: pod_spec(manager(d)).update(terminationGracePeriodSeconds=5),
                                   check_replicas_and_rollout),
    "drain longer than the grace": (lambda d: _set_drain(d, 45), check_replicas_and_rollout),
    "default drain, short grace": (lambda d: (_set_drain(d, None), pod_spec(manager(d)).update(
        terminationGracePeriodSeconds=40)), check_replicas_and_rollout),
    "no PDB": (lambda d: _drop(d, "PodDisruptionBudget", "kernelmode"), check_disruption_budget),
    "PDB selects MinIO": (lambda d: find(d, "PodDisruptionBudget", "kernelmode")["spec"]["selector"]["matchLabels"]
                          .update({"app.kubernetes.io/component": "minio"}), check_disruption_budget),
    "PDB allows none": (lambda d: find(d, "PodDisruptionBudget", "kernelmode")["spec"].update(maxUnavailable=0),
                        check_disruption_budget),
    "PDB minAvailable = replicas": (
        lambda d: find(d, "PodDisruptionBudget", "kernelmode").update(
            spec={"minAvailable": manager(d)["spec"]["replicas"],
                  "selector": find(d, "PodDisruptionBudget", "kernelmode")["spec"]["selector"]}),
        check_disruption_budget),
    "no spread": (lambda d: pod_spec(manager(d)).pop("topologySpreadConstraints"), check_spread_over_nodes),
    "readiness on /healthz": (lambda d: _mgr(d)["readinessProbe"]["httpGet"].update(path="/healthz"), check_probes),
    "readiness on no route": (lambda d: _mgr(d)["readinessProbe"]["httpGet"].update(path="/ready"), check_probes),
    "store url in plain text": (lambda d: _mgr(d)["env"].__setitem__(
        next(i for i, e in enumerate(_mgr(d)["env"]) if e["name"] == "KERNELMODE_STORE__URL"),
        {"name": "KERNELMODE_STORE__URL", "value": "postgresql://kernelmode:pw@postgres:5432/kernelmode"}),
        check_store_and_advertise_url),
    "POD_IP defined after its use": (lambda d: _env_first(d, "POD_IP"), check_store_and_advertise_url),
    "advertise 0.0.0.0": (lambda d: next(e for e in _mgr(d)["env"] if e["name"] == "KERNELMODE_SERVER__ADVERTISE_URL")
                          .update(value="http://0.0.0.0:8888"), check_store_and_advertise_url),
    "postgres open to the namespace": (lambda d: _policy(d, "postgres")["spec"]["ingress"][0].update(
        {"from": [{"podSelector": {}}]}), check_store_paths),
    "no postgres policy": (lambda d: _drop(d, "NetworkPolicy", "postgres"), check_store_paths),
    "no manager-peers policy": (lambda d: _drop(d, "NetworkPolicy", "manager-peers-and-store"), check_store_paths),
    "PGDATA is the mount point": (lambda d: next(e for e in container(find(d, "StatefulSet", "postgres"))["env"]
                                                 if e["name"] == "PGDATA").update(value="/var/lib/postgresql/data"),
                                  check_reference_postgres),
    "writable root": (lambda d: container(find(d, "StatefulSet", "postgres"))["securityContext"].update(
        readOnlyRootFilesystem=False), check_reference_postgres),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_each_check_fails_on_a_broken_manifest(base: Docs, breakage: str) -> None:
    broken = copy.deepcopy(base)
    mutate, check = BREAKAGES[breakage]
    mutate(broken)
    with pytest.raises(AssertionError):
        check(broken)
