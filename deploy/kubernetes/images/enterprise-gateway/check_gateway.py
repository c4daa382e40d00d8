"""Check a built Enterprise Gateway image as the Deployment runs it, without a cluster.

    docker build -t kernelmode/enterprise-gateway:3.3.0 deploy/kubernetes/images/enterprise-gateway
    .venv/bin/python deploy/kubernetes/images/enterprise-gateway/check_gateway.py [IMAGE]

Starts the image with the Deployment's command and env (read from deploy/kubernetes/base), the
kernelspec files mounted where the Deployment mounts them, read-only root, uid 10002, no
capabilities, on an internal Docker network of its own (no route out; EG needs an interface
besides lo). Then, from inside the container: its API answers with the token and refuses without
it, the whitelist leaves only `kernelmode`; and EG's own launch_kubernetes.py renders the kernel pod
(`--pod-template`: render only, against a kubeconfig that is parsed and never contacted), which
must be valid for the stated Kubernetes versions and identical to what
tests/kubernetes_render.py renders (the container's env aside: `docker exec` adds the gateway's
own variables, which EG itself never hands a launcher). Exits non-zero when any of that fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))

import kubernetes_validate  # noqa: E402
import yaml  # noqa: E402

from kernelmode.gateway.launch import launch_env  # noqa: E402
from kernelmode.models import Limits  # noqa: E402
from tests.kubernetes_render import (  # noqa: E402
    container_env,
    find,
    kernelspec_files,
    kustomize,
    launcher_env,
    pod_spec,
    render_kernel_pod,
)

TOKEN = "check-token-" + uuid.uuid4().hex
ASK = """\
import json, urllib.error, urllib.request
def get(path, token):
    req = urllib.request.Request('http://127.0.0.1:8888' + path, headers={'Authorization': 'token ' + token} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as f:
            return f.status, json.load(f)
    except urllib.error.HTTPError as e:
        return e.code, None
def start_without_username():
    req = urllib.request.Request('http://127.0.0.1:8888/api/kernels', method='POST',
                                 data=json.dumps({'name': 'kernelmode', 'env': {}}).encode(),
                                 headers={'Authorization': 'token ' + TOKEN, 'Content-Type': 'application/json'})
    try:
        with urllib.request.urlopen(req, timeout=30) as f:
            return f.status
    except urllib.error.HTTPError as e:
        return e.code
print(json.dumps({"api": get('/api', TOKEN), "specs": get('/api/kernelspecs', TOKEN),
                  "no_token": get('/api/kernelspecs', ''), "kernels": get('/api/kernels', TOKEN),
                  "no_username": start_without_username()}))
""".replace("TOKEN", repr(TOKEN))
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]
users: [{name: u, user: {token: x}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def main() -> int:
    image = sys.argv[1] if len(sys.argv) > 1 else "kernelmode/enterprise-gateway:3.3.0"
    docs = kustomize(REPO / "deploy" / "kubernetes" / "base")
    eg = find(docs, "Deployment", "enterprise-gateway", "kernelmode")
    c = pod_spec(eg)["containers"][0]
    files, spec = kernelspec_files(docs)
    env = {**container_env(eg), "EG_AUTH_TOKEN": TOKEN, "EG_NAMESPACE": "kernelmode"}
    tmp = Path("/tmp") / f"kernelmode-eg-check-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    for name, text in files.items():
        (tmp / name).write_text(text)
        (tmp / name).chmod(0o644)
    net = name = tmp.name
    run("docker", "network", "create", "--internal", net).check_returncode()
    cmd = ["docker", "run", "-d", "--name", name, "--network", net, "--read-only", "--tmpfs", "/tmp:size=256m,mode=1777",
           "--user", "10002:10002", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    cmd += [x for k, v in env.items() for x in ("-e", f"{k}={v}")]
    cmd += [x for m in c["volumeMounts"] if m.get("subPath") for x in ("-v", f"{tmp / m['subPath']}:{m['mountPath']}:ro")]
    ok = False
    try:
        run(*cmd, image, *c["command"]).check_returncode()
        for _ in range(90):
            r = run("docker", "exec", name, "/opt/eg-venv/bin/python", "-c", ASK)
            if r.returncode == 0:
                break
            time.sleep(1)
        answers = json.loads(r.stdout)
        specs = answers["specs"][1]
        print("GET /api:", answers["api"], "| kernelspecs:", sorted(specs["kernelspecs"]), "default:", specs["default"],
              "| without token:", answers["no_token"][0], "| GET /api/kernels:", answers["kernels"],
              "| a start without KERNEL_USERNAME (eg_patches.py applied):", answers["no_username"])
        api_ok = (answers["api"][0] == 200 and sorted(specs["kernelspecs"]) == ["kernelmode"]
                  and answers["no_token"][0] == 401 and answers["kernels"] == [200, []]
                  and answers["no_username"] == 403)
        kid = str(uuid.uuid4())
        lenv = launcher_env(spec, launch_env("team-a", Limits(memory_mb=2048, disk_mb=512)), kid, env)
        run("docker", "exec", name, "/opt/eg-venv/bin/python", "-c",
            f"open('/tmp/kubeconfig', 'w').write({KUBECONFIG!r})").check_returncode()
        args = {"PATH", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "PORT_RANGE", "RESPONSE_ADDRESS",
                "PUBLIC_KEY", "KERNEL_ID", "KERNEL_NAME"}  # set by the launcher from its arguments, or not at all
        exec_env = [x for k, v in lenv.items() if k not in args for x in ("-e", f"{k}={v}")]
        r = run("docker", "exec", *exec_env, "-e", "KUBECONFIG=/tmp/kubeconfig", name, "/opt/eg-venv/bin/python",
                "/usr/local/share/jupyter/kernels/kernelmode/scripts/launch_kubernetes.py", "--kernel-id", kid,
                "--port-range", lenv["PORT_RANGE"], "--response-address", lenv["RESPONSE_ADDRESS"],
                "--public-key", lenv["PUBLIC_KEY"], "--pod-template", "/tmp/pod.yaml")
        if r.returncode:
            print("launch_kubernetes.py failed:", r.stderr[-2000:])
            return 1
        real = yaml.safe_load(run("docker", "exec", name, "cat", "/tmp/pod.yaml").stdout)
        for version in ("1.30.0", "1.37.0"):
            kubernetes_validate.validate(real, version, strict=True)
        mine = render_kernel_pod(files, lenv)

        def without_env(pod: dict[str, Any]) -> dict[str, Any]:
            pod = json.loads(json.dumps(pod))
            pod["spec"]["containers"][0].pop("env")
            return pod

        same = without_env(real) == without_env(mine)
        print("EG's own render: valid for 1.30 and 1.37; identical to tests/kubernetes_render.py (env aside):", same)
        print("its resources:", real["spec"]["containers"][0]["resources"])
        ok = api_ok and same
    finally:
        logs = run("docker", "logs", name)
        if not ok:
            print("EG log:", (logs.stdout + logs.stderr)[-3000:])
        run("docker", "rm", "-f", name)
        run("docker", "network", "rm", net)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
