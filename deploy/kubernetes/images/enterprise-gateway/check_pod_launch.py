"""One kernel start through Enterprise Gateway's Kubernetes path, without a cluster.

    make k8s-check          (builds the images, then runs this among the checks)

EG (the image, with the Deployment's command, env and kernelspec) runs on an internal Docker
network of its own. In place of the Kubernetes API, this script serves the few calls EG and its
launcher make (create, list, delete pods in the kernel namespace) over HTTPS with a CA and token
of its own, mounted where a pod finds its service account; when EG's launcher creates the kernel
pod, the script starts that pod's container itself (the pod's image, command, args with `$(VAR)`
expanded, env, user, read-only root, emptyDirs as tmpfs) on the same network, and reports it
Running with its address, as a kubelet would. Then the manager's own gateway client
(kernelmode/gateway/client.py) starts the kernel with the manager's launch parameters, opens its
websocket through EG and gets kernel_info back from the kernel in the "pod". Finally the pod body
EG created is checked (valid, strict; no secret of EG's in its env) and the kernel is shut down.
Traffic stays on this host (the Docker bridge of that internal network). Exits non-zero on failure.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import http.server
import ipaddress
import json
import re
import ssl
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))

import kubernetes_validate  # noqa: E402
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from kernelmode.gateway.client import GatewayClient  # noqa: E402
from kernelmode.gateway.launch import launch_env  # noqa: E402
from kernelmode.models import Limits  # noqa: E402
from kernelmode.sandbox.spec import KernelParams  # noqa: E402
from tests.kubernetes_render import container_env, find, kernelspec_files, kustomize, pod_spec  # noqa: E402

TOKEN = "check-token-" + uuid.uuid4().hex
SA_TOKEN = "sa-" + uuid.uuid4().hex


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def self_signed(ip: str, d: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (d / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    (d / "token").write_text(SA_TOKEN)
    (d / "namespace").write_text("kernelmode")
    for f in d.iterdir():
        f.chmod(0o644)


class FakeCluster:
    """The pods EG asked for, each a container started here."""

    def __init__(self, net: str) -> None:
        self.net = net
        self.pods: dict[str, dict[str, Any]] = {}  # name -> pod (with status)
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def create(self, ns: str, pod: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(json.loads(json.dumps(pod)))
        c = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value", "") for e in c.get("env", [])}

        def expand(s: str) -> str:
            return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), s)

        psc, csc = pod["spec"].get("securityContext", {}), c.get("securityContext", {})
        name = pod["metadata"]["name"]
        cmd = ["docker", "run", "-d", "--name", f"kpod-{name}"[:60], "--network", self.net,
               "--user", f"{psc['runAsUser']}:{psc['runAsGroup']}", "--security-opt", "no-new-privileges"]
        if csc.get("readOnlyRootFilesystem"):
            cmd.append("--read-only")
        if csc.get("capabilities", {}).get("drop") == ["ALL"]:
            cmd += ["--cap-drop", "ALL"]
        vols = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for m in c.get("volumeMounts", []):
            size = vols[m["name"]]["emptyDir"]["sizeLimit"].removesuffix("Mi")
            cmd += ["--tmpfs", f"{m['mountPath']}:size={size}m,uid={psc['runAsUser']},gid={psc['runAsGroup']}"]
        cmd += [x for k, v in env.items() for x in ("-e", f"{k}={v}")]
        if c.get("workingDir"):
            cmd += ["-w", c["workingDir"]]
        cmd += ["--entrypoint", c["command"][0], c["image"], *[expand(a) for a in c["command"][1:]],
                *[expand(a) for a in c.get("args", [])]]
        run(*cmd).check_returncode()
        ip = run("docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                 f"kpod-{name}"[:60]).stdout.strip()
        pod = {**pod, "metadata": {**pod["metadata"], "uid": str(uuid.uuid4()), "namespace": ns},
               "status": {"phase": "Running", "podIP": ip, "hostIP": ip}}
        with self.lock:
            self.pods[name] = pod
        return pod

    def listing(self, ns: str, selector: str) -> dict[str, Any]:
        want = dict(kv.split("=", 1) for kv in selector.split(",") if kv)
        with self.lock:
            items = [p for p in self.pods.values() if p["metadata"]["namespace"] == ns
                     and all(p["metadata"]["labels"].get(k) == v for k, v in want.items())]
        return {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}

    def delete(self, name: str) -> dict[str, Any]:
        with self.lock:
            pod = self.pods.pop(name, None)
        run("docker", "rm", "-f", f"kpod-{name}"[:60])
        if pod is None:
            return {}
        return {**pod, "status": {"phase": "Succeeded"}}

    def remove_all(self) -> None:
        for name in list(self.pods):
            self.delete(name)


def api_server(cluster: FakeCluster, ip: str, certs: Path) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def answer(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def route(self, method: str) -> None:
            if (self.headers.get("Authorization") or "").lower() != f"bearer {SA_TOKEN}":
                return self.answer(401, {"kind": "Status", "code": 401})
            u = urlsplit(self.path)
            m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?", u.path)
            if not m:
                return self.answer(404, {"kind": "Status", "code": 404, "message": u.path})
            ns, name = m.groups()
            if method == "POST" and not name:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                return self.answer(201, cluster.create(ns, body))
            if method == "GET" and not name:
                return self.answer(200, cluster.listing(ns, parse_qs(u.query).get("labelSelector", [""])[0]))
            if method == "DELETE" and name:
                return self.answer(200, cluster.delete(name))
            return self.answer(405, {"kind": "Status", "code": 405})

        def do_GET(self) -> None:
            self.route("GET")

        def do_POST(self) -> None:
            self.route("POST")

        def do_DELETE(self) -> None:
            self.route("DELETE")

    srv = http.server.ThreadingHTTPServer((ip, 0), Handler)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs / "ca.crt", certs / "key.pem")
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


async def drive(url: str, limits: Limits) -> tuple[str, dict[str, Any]]:
    """What the manager does for a new kernel: start it with its env, connect, kernel_info."""
    gw = GatewayClient(url, TOKEN, request_timeout=180)
    kid = str(uuid.uuid4())
    env = {**KernelParams(Path("/unused"), limits, "s1").to_env(), **launch_env("team-a", limits)}
    # EG 3.3.0 (jupyter_server 1.x) ignores the body's "kernel_id", which is how the manager names
    # its kernels to Kernel Gateway; EG takes the id from env KERNEL_ID instead. Without this
    # line the manager's client refuses the start ("started kernel X instead of Y").
    env["KERNEL_ID"] = kid
    await gw.start_kernel(kid, env, timeout=170)
    conn = await gw.connect(kid, lambda state: None)
    try:
        info = await conn.kernel_info(60)
    finally:
        await conn.close()
    await gw.shutdown_kernel(kid)
    return kid, info


def main() -> int:
    image = sys.argv[1] if len(sys.argv) > 1 else "kernelmode/enterprise-gateway:3.3.0"
    docs = kustomize(REPO / "deploy" / "kubernetes" / "base")
    eg = find(docs, "Deployment", "enterprise-gateway", "kernelmode")
    c = pod_spec(eg)["containers"][0]
    files, _ = kernelspec_files(docs)
    tmp = Path("/tmp") / f"kernelmode-eg-launch-{uuid.uuid4().hex[:8]}"
    (tmp / "sa").mkdir(parents=True)
    for name, text in files.items():
        (tmp / name).write_text(text)
        (tmp / name).chmod(0o644)
    net = name = tmp.name
    run("docker", "network", "create", "--internal", net).check_returncode()
    gw_ip = json.loads(run("docker", "network", "inspect", net, "-f", "{{json .IPAM.Config}}").stdout)[0]["Gateway"]
    self_signed(gw_ip, tmp / "sa")
    cluster = FakeCluster(net)
    srv = api_server(cluster, gw_ip, tmp / "sa")
    env = {**container_env(eg), "EG_AUTH_TOKEN": TOKEN, "EG_NAMESPACE": "kernelmode",
           "KUBERNETES_SERVICE_HOST": gw_ip, "KUBERNETES_SERVICE_PORT": str(srv.server_address[1])}
    cmd = ["docker", "run", "-d", "--name", name, "--network", net, "--read-only", "--tmpfs", "/tmp:size=256m,mode=1777",
           "--user", "10002:10002", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
           "-v", f"{tmp / 'sa'}:/var/run/secrets/kubernetes.io/serviceaccount:ro"]
    cmd += [x for k, v in env.items() for x in ("-e", f"{k}={v}")]
    cmd += [x for m in c["volumeMounts"] if m.get("subPath") for x in ("-v", f"{tmp / m['subPath']}:{m['mountPath']}:ro")]
    ok = False
    try:
        run(*cmd, image, *c["command"]).check_returncode()
        eg_ip = run("docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name).stdout.strip()
        url = f"http://{eg_ip}:8888"
        for _ in range(60):
            if run("docker", "exec", name, "/opt/eg-venv/bin/python", "-c",
                   "import socket; socket.create_connection(('127.0.0.1', 8888), 1)").returncode == 0:
                break
            asyncio.run(asyncio.sleep(1))
        limits = Limits(memory_mb=1536, disk_mb=256)
        kid, info = asyncio.run(drive(url, limits))
        print("kernel started through EG's Kubernetes proxy; kernel_info through EG's websocket:",
              info.get("implementation"), info.get("implementation_version"))
        assert len(cluster.bodies) == 1, cluster.bodies
        pod = cluster.bodies[0]
        for version in ("1.30.0", "1.37.0"):
            kubernetes_validate.validate(pod, version, strict=True)
        penv = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        # EG adds a few of its own settings (EG_MIN_PORT_RANGE_SIZE, ...); no secret may follow.
        leaked = sorted(k for k, v in penv.items() if TOKEN in str(v) or SA_TOKEN in str(v)
                        or re.search(r"TOKEN|SECRET|PASSWORD", k))
        res = pod["spec"]["containers"][0]["resources"]
        print("pod created by EG: valid for 1.30 and 1.37; namespace", pod["metadata"]["namespace"], "| limits",
              res["limits"], "| KERNEL_USERNAME", penv.get("KERNEL_USERNAME"), "| secrets in its env:",
              leaked, "| EG_* in its env:", sorted(k for k in penv if k.startswith("EG_")))
        ok = (not leaked and res["limits"]["memory"] == "1536Mi" and pod["metadata"]["namespace"] == "kernelmode-kernels"
              and penv.get("KERNEL_USERNAME") == "team-a" and pod["metadata"]["labels"]["kernel_id"] == kid
              and not cluster.pods)
        print("the pod was deleted when the kernel was shut down:", not cluster.pods)
    finally:
        if not ok:
            logs = run("docker", "logs", name)
            print("EG log:", (logs.stdout + logs.stderr)[-4000:])
        cluster.remove_all()
        run("docker", "rm", "-f", name)
        srv.shutdown()
        run("docker", "network", "rm", net)
        for f in sorted(tmp.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        tmp.rmdir()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
