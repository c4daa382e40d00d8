"""Check a built kernel-eg image the way a kernel pod runs it, without a cluster (loopback only).

    docker build -t kernelmode/kernel-eg:latest deploy/kubernetes/images/kernel
    .venv/bin/python deploy/kubernetes/images/kernel/check_launcher.py [IMAGE]

Runs the pod template's command (EG's launch_ipykernel.py) in a container locked down like the pod
(read-only root, uid 1000, no capabilities, no-new-privileges, tmpfs /tmp and /mnt/data), plays
Enterprise Gateway's response port (an RSA key of its own; the launcher sends the connection info
encrypted with it), then drives the kernel with jupyter_client: a file in /mnt/data, a refused
write to /etc, no capabilities, pandas imports, IPython's history in memory (the image's
ipython_kernel_config.json: the launcher passes no IPython options); prints the container's memory idle and with pandas, and how long the start took. Exits non-zero when any of that fails.
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from jupyter_client import BlockingKernelClient

PORT_RANGE = (40000, 41000)
CODE = """\
import os, pathlib, pandas
pathlib.Path('x.txt').write_text('hi')
try:
    open('/etc/evil', 'w'); read_only = False
except OSError:
    read_only = True
cap_eff = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0]
hm = get_ipython().history_manager
print(json.dumps({"uid": os.getuid(), "cwd": os.getcwd(), "files": os.listdir('.'), "read_only": read_only,
                  "cap_eff": cap_eff, "pandas": pandas.__version__,
                  "hist_file": str(hm.hist_file), "history_thread": hm.save_thread is not None}))
"""


def decrypt(data: bytes, key: rsa.RSAPrivateKey) -> dict[str, Any]:
    """The launcher's payload: base64 JSON of an RSA(PKCS1 v1.5)-wrapped AES key and AES-ECB data."""
    payload = json.loads(base64.b64decode(data))
    aes = key.decrypt(base64.b64decode(payload["key"]), padding.PKCS1v15())
    d = Cipher(algorithms.AES(aes), modes.ECB()).decryptor()  # noqa: S305 - EG's launcher protocol
    raw = d.update(base64.b64decode(payload["conn_info"])) + d.finalize()
    return dict(json.loads(raw[: -raw[-1]]))


def memory(container: str) -> str:
    """The container's memory as the engine reports it (what a pod's working set is close to)."""
    time.sleep(1.0)  # let the kernel settle after its reply
    return subprocess.run(["docker", "stats", "--no-stream", "--format", "{{.MemUsage}}", container],
                          capture_output=True, text=True, timeout=60, check=True).stdout.split("/")[0].strip()


def main() -> int:
    image = sys.argv[1] if len(sys.argv) > 1 else "kernelmode/kernel-eg:latest"
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pub = base64.b64encode(key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)).decode()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(60)
    kid = str(uuid.uuid4())
    name = f"kernelmode-launcher-check-{kid[:8]}"
    t0 = time.perf_counter()
    subprocess.run([
        "docker", "run", "-d", "--rm", "--name", name, "--network", "host", "--read-only",
        "--tmpfs", "/tmp:size=256m", "--tmpfs", "/mnt/data:size=64m,uid=1000,gid=1000", "--user", "1000:1000",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "-e", "LOG_LEVEL=30", "-e", "HOME=/tmp",
        "-w", "/mnt/data", image,
        "/opt/kernel-venv/bin/python", "/usr/local/share/kernelmode/launch_ipykernel.py",
        "--kernel-id", kid, "--port-range", f"{PORT_RANGE[0]}..{PORT_RANGE[1]}",
        "--response-address", f"127.0.0.1:{srv.getsockname()[1]}", "--public-key", pub,
    ], check=True, capture_output=True, timeout=120)
    try:
        conn, _ = srv.accept()
        t_response = time.perf_counter() - t0
        conn.settimeout(10)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        info = decrypt(data, key)
        ports = {k: v for k, v in info.items() if k.endswith("_port")}
        assert info["kernel_id"] == kid and all(PORT_RANGE[0] <= p <= PORT_RANGE[1] for p in ports.values()), info
        kc = BlockingKernelClient()
        kc.load_connection_info({**info, "ip": "127.0.0.1"})
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        t_ready = time.perf_counter() - t0
        kc.execute_interactive("1+1", timeout=60, output_hook=lambda m: None)
        idle = memory(name)
        out: list[str] = []
        reply = kc.execute_interactive("import json\n" + CODE, timeout=120, output_hook=lambda m: out.append(
            m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
        with_pandas = memory(name)
        kc.shutdown()
        kc.stop_channels()
        facts = json.loads("".join(out))
        print("ports", ports, "\nkernel", facts)
        print(f"docker run -> connection info at the response port: {t_response:.2f} s; -> kernel_info answered: "
              f"{t_ready:.2f} s")
        print(f"container memory (docker stats: cgroup usage less inactive file pages, as the kubelet counts a working set): idle {idle}, "
              f"after import pandas {with_pandas}")
        ok = (reply["content"]["status"] == "ok" and facts["uid"] == 1000 and facts["read_only"]
              and facts["cap_eff"] == "0000000000000000" and facts["files"] == ["x.txt"]
              and facts["hist_file"] == ":memory:" and not facts["history_thread"])
    finally:
        logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True, timeout=30)
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
    leaked = info["key"] in logs.stdout + logs.stderr  # the HMAC key: logged at level 10 only
    print("launcher log: HMAC key present:", leaked)
    print("OK" if ok and not leaked else "FAILED")
    return 0 if ok and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
