"""deploy/kubernetes/ rendered offline, as `kubectl apply -k` and Enterprise Gateway would render it.

- ``kustomize(dir)``: the objects of a kustomization (resources, configMapGenerator with
  create/merge, generatorOptions). Only the fields deploy/kubernetes uses are read; any other
  field is an error, so that a manifest change this renderer does not understand fails the test
  instead of being skipped.
- ``render_kernel_pod(files, env)``: the kernel pod as EG 3.3.0's launch_kubernetes.py makes it:
  the jinja2 environment it builds (trim_blocks, lstrip_blocks, autoescape off for .j2, its
  ``yaml_safe`` filter), one variable per KERNEL_* value lower-cased, then the launcher's whole
  environment appended to the container's env (``extend_pod_env``).
- ``launcher_env(...)``: that environment, assembled as EG does for a kernel start (kernelspec
  env as defaults, the client's KERNEL_* values over them, then what EG itself sets).
- ``kubelet_env(container, secret, pod_ip)``: a container's environment as the kubelet builds it
  (Secret references, the pod's address, ``$(VAR)`` expansion).
- ``Cluster``: pods, namespaces and NetworkPolicies, and ``allowed(src, dst, port)`` evaluated
  the way the NetworkPolicy API defines it (both the source's egress and the destination's
  ingress must allow a connection; a pod no policy selects is open in that direction).
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions"}
GENERATOR_KEYS = {"name", "namespace", "files", "behavior"}


def kustomize(root: Path) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k root` would apply (hash suffixes disabled, as in base)."""
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise ValueError(f"{root}/kustomization.yaml: fields this renderer does not read: {sorted(unknown)}")
    opts = k.get("generatorOptions", {})
    if k.get("configMapGenerator") and opts != {"disableNameSuffixHash": True}:
        raise ValueError(f"{root}: configMapGenerator without disableNameSuffixHash (EG mounts a fixed name)")
    docs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        path = (root / res).resolve()
        if path.is_dir():
            docs += kustomize(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in k.get("configMapGenerator", []):
        if set(gen) - GENERATOR_KEYS:
            raise ValueError(f"{root}: configMapGenerator fields not read: {sorted(set(gen) - GENERATOR_KEYS)}")
        data = {Path(f).name: (root / f).read_text() for f in gen.get("files", [])}
        same = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == gen["name"]
                and d["metadata"].get("namespace") == gen.get("namespace")]
        behavior = gen.get("behavior", "create")
        if behavior == "create":
            assert not same, f"{root}: ConfigMap {gen['name']} generated twice"
            docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                         "metadata": {"name": gen["name"], "namespace": gen["namespace"]}, "data": data})
        elif behavior == "merge":
            assert len(same) == 1, f"{root}: merge into ConfigMap {gen['name']}, which the base lacks"
            same[0]["data"].update(data)
        else:
            raise ValueError(f"{root}: configMapGenerator behavior {behavior!r} not read")
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name
            and (namespace is None or d["metadata"].get("namespace") == namespace)]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


# -- the kernel pod, as EG's launcher renders it ---------------------------------------------------

def yaml_safe(value: Any) -> str:
    """EG 3.3.0 launch_kubernetes.py ``yaml_safe_str``: a value YAML reads back as itself."""
    if isinstance(value, str):
        return yaml.dump(value, default_style='"', width=10000).strip()
    if isinstance(value, (dict, list)):
        return yaml.dump(value, default_flow_style=True, width=10000).strip()
    return yaml.dump(value, width=10000).replace("\n...", "").strip()


def launcher_env(kernelspec: dict[str, Any], client_env: dict[str, str], kernel_id: str,
                 eg_env: dict[str, str]) -> dict[str, str]:
    """The environment EG starts launch_kubernetes.py with (EG 3.3.0: the kernelspec's env, the client's KERNEL_* values over it (RemoteKernelManager user overrides),
    then what KubernetesProcessProxy and the launcher set)."""
    env = dict(kernelspec.get("env", {}))  # no PATH: EG starts the launcher with the kernel's env only
    env.update({k: v for k, v in client_env.items() if k.startswith("KERNEL_")})
    env["KERNEL_GATEWAY"] = "1"
    env.setdefault("KERNEL_USERNAME", eg_env["USER"])  # EG: getpass.getuser() when the client sends none
    env["KERNEL_POD_NAME"] = f"{env['KERNEL_USERNAME']}-{kernel_id}".lower().replace("_", "-").replace(".", "-")
    env.setdefault("KERNEL_SERVICE_ACCOUNT_NAME", eg_env["EG_DEFAULT_KERNEL_SERVICE_ACCOUNT_NAME"])
    env.setdefault("KERNEL_IMAGE", kernelspec["metadata"]["process_proxy"]["config"]["image_name"])
    env["KERNEL_EXECUTOR_IMAGE"] = env["KERNEL_IMAGE"]
    env.setdefault("KERNEL_UID", "1000")
    env.setdefault("KERNEL_GID", "100")
    env.update({"KERNEL_ID": kernel_id, "KERNEL_NAME": "kernelmode", "PORT_RANGE": eg_env["EG_PORT_RANGE"],
                "RESPONSE_ADDRESS": f"10.0.0.7:{eg_env['EG_RESPONSE_PORT']}", "PUBLIC_KEY": "MIIBIjANBgkqhkiG9w0B",
                "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    return env


def render_kernel_pod(files: dict[str, str], env: dict[str, str]) -> dict[str, Any]:
    """launch_kubernetes.py's ``generate_kernel_pod_yaml`` + ``extend_pod_env`` for ``env``."""
    with tempfile.TemporaryDirectory() as d:
        for name, text in files.items():
            (Path(d) / name).write_text(text)
        j_env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(d), trim_blocks=True, lstrip_blocks=True,
            autoescape=jinja2.select_autoescape(disabled_extensions=("j2", "yaml"), default_for_string=True,
                                                default=True))
        j_env.filters["yaml_safe"] = yaml_safe
        keywords = {k.lower(): v for k, v in env.items() if k.startswith("KERNEL_")}
        text = j_env.get_template("/kernel-pod.yaml.j2").render(**keywords)
    pods = [d for d in yaml.safe_load_all(text) if d]
    assert len(pods) == 1 and pods[0]["kind"] == "Pod", text
    pod = pods[0]
    stanza = pod["spec"]["containers"][0].get("env") or []
    done = set()
    for item in stanza:
        if item["name"] in env:
            item["value"] = env[item["name"]]
            done.add(item["name"])
    stanza += [{"name": k, "value": v} for k, v in env.items() if k not in done]
    pod["spec"]["containers"][0]["env"] = stanza
    return pod


def kernelspec_files(docs: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, Any]]:
    """The kernelspec ConfigMap's files and its kernel.json."""
    cm = find(docs, "ConfigMap", "kernelmode-kernelspec", "kernelmode")
    return dict(cm["data"]), json.loads(cm["data"]["kernel.json"])


def container_env(doc: dict[str, Any]) -> dict[str, str]:
    """Plain ``value`` env entries of a workload's first container."""
    c = pod_spec(doc)["containers"][0]
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def kubelet_env(container: dict[str, Any], secret: dict[str, str], pod_ip: str) -> dict[str, str]:
    """A container's environment as the kubelet builds it: ``secretKeyRef`` values from
    ``secret``, ``fieldRef: status.podIP`` as ``pod_ip``, and ``$(VAR)`` in a value expanded
    when VAR is defined above it (left as it is otherwise, as the kubelet does; ``$$`` is ``$``)."""
    env: dict[str, str] = {}

    def expand(m: re.Match[str]) -> str:
        return "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0))

    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\$|\$\((\w+)\)", expand, e["value"])
        elif ref := e.get("valueFrom", {}).get("secretKeyRef"):
            env[e["name"]] = secret[ref["key"]]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = pod_ip
        else:
            raise ValueError(f"env {e['name']}: a source this renderer does not read")
    return env


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    return dict(doc["metadata"]["labels"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]["labels"])


# -- NetworkPolicy semantics ----------------------------------------------------------------------

def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) against ``labels``."""
    if selector is None:
        return True
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str | None  # None: outside the cluster (a client, the internet)
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


@dataclass
class Cluster:
    namespaces: dict[str, dict[str, str]] = field(default_factory=dict)
    policies: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, docs: list[dict[str, Any]]) -> Cluster:
        c = cls()
        for d in docs:
            if d["kind"] == "Namespace":
                name = d["metadata"]["name"]
                c.namespaces[name] = {**d["metadata"].get("labels", {}), "kubernetes.io/metadata.name": name}
            elif d["kind"] == "NetworkPolicy":
                c.policies.append(d)
        c.namespaces.setdefault("kube-system", {"kubernetes.io/metadata.name": "kube-system"})
        return c

    def selecting(self, pod: Pod, direction: str) -> list[dict[str, Any]]:
        """The policies of ``direction`` (Ingress/Egress) that select ``pod``."""
        return [p for p in self.policies if p["metadata"]["namespace"] == pod.namespace
                and direction in p["spec"].get("policyTypes", ["Ingress"])
                and selects(p["spec"]["podSelector"], pod.label_map)]

    def _peer_matches(self, peer: dict[str, Any], policy_ns: str, other: Pod) -> bool:
        if "ipBlock" in peer:  # this model: an ipBlock stands for addresses outside the cluster
            return other.namespace is None
        if other.namespace is None:
            return False
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"], self.namespaces.get(other.namespace, {})):
                return False
        elif other.namespace != policy_ns:
            return False
        return selects(peer.get("podSelector"), other.label_map)

    @staticmethod
    def _port_matches(ports: list[dict[str, Any]] | None, port: int, protocol: str) -> bool:
        if not ports:
            return True
        for p in ports:
            if p.get("protocol", "TCP") != protocol:
                continue
            if "port" not in p:
                return True
            assert isinstance(p["port"], int), "named ports are not modelled: use numbers"
            if p["port"] <= port <= p.get("endPort", p["port"]):
                return True
        return False

    def _side(self, pod: Pod, other: Pod, port: int, protocol: str, direction: str) -> bool:
        if pod.namespace is None:  # outside the cluster: no policy applies there
            return True
        pols = self.selecting(pod, direction)
        if not pols:
            return True
        key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        for pol in pols:
            for rule in pol["spec"].get(key, []):
                who = rule.get(peers)
                if (not who or any(self._peer_matches(p, pod.namespace, other) for p in who)) \
                        and self._port_matches(rule.get("ports"), port, protocol):
                    return True
        return False

    def allowed(self, src: Pod, dst: Pod, port: int, protocol: str = "TCP") -> bool:
        """May ``src`` open a connection to ``dst``:``port``?"""
        return (self._side(src, dst, port, protocol, "Egress")
                and self._side(dst, src, port, protocol, "Ingress"))
