"""Attacks from a kernel on a node, and on the launch path: every address tried is one of the
rig's test addresses (listeners the test opens itself), never anything outside the machine.

- a kernel on node A reaches neither node B (its sshd, a port in B's kernel range) nor the
  manager's API port on the bridge; its routes end at the test subnet; the node's nftables rules
  are in place and the kernel (no root, no capabilities) cannot change them;
- ``KERNEL_*`` values that would inject into EG's SSH launch line do not execute on the node
  (the quoting patch), and a start without ``KERNEL_USERNAME`` is refused;
- the launcher's signal ("comm") port answers the gateway's address only.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from collections.abc import Iterator

import pytest

from tests.cluster.test_cluster import node_of, run
from tests.support.cluster.eg import KERNEL_NAME
from tests.support.cluster.rig import Rig

PROBE = """
import socket
s = socket.socket()
s.settimeout(3)
try:
    s.connect(({host!r}, {port}))
    r = 'connected'
except OSError as e:
    r = type(e).__name__
finally:
    s.close()
r
"""

# The launcher's signal port: a listening socket of this sandbox's own processes, on an address
# other than loopback, that is none of the kernel's five ZMQ ports. (ipykernel's IOPub pipe also
# listens, on 127.0.0.1 at a random ephemeral port, which can fall inside the node's port range.)
COMM_PORT = """
import os, re
from ipykernel.kernelapp import IPKernelApp
app = IPKernelApp.instance()
zmq_ports = {app.shell_port, app.iopub_port, app.stdin_port, app.control_port, app.hb_port}
mine = set()
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        for fd in os.listdir(f'/proc/{pid}/fd'):
            m = re.match(r'socket:\\[(\\d+)\\]', os.readlink(f'/proc/{pid}/fd/{fd}'))
            if m:
                mine.add(m.group(1))
    except OSError:
        pass
ports = set()
for line in open('/proc/net/tcp').read().splitlines()[1:]:
    f = line.split()
    if f[3] == '0A' and f[9] in mine and not f[1].startswith('0100007F:'):
        ports.add(int(f[1].split(':')[1], 16))
sorted(ports - zmq_ports)
"""


@pytest.fixture(scope="module")
def on_a(served, rig) -> Iterator[tuple[object, str]]:
    """A session whose kernel runs on node A (least-connection places them on both nodes)."""
    with served.client() as c:
        for i in range(4):
            sid = f"iso-{i}"
            assert c.post("/v1/sessions", json={"session_id": sid}).status_code == 201
            if node_of(c, rig, sid) == "a":
                yield c, sid
                return
        pytest.fail("no session landed on node a")


@contextlib.contextmanager
def listener(address: str, port: int = 0) -> Iterator[socket.socket]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, port))
    s.listen(4)
    s.setblocking(False)
    try:
        yield s
    finally:
        s.close()


def accepted(s: socket.socket) -> bool:
    try:
        conn, _ = s.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def connect_from(source: str, host: str, port: int, send: bytes | None = None) -> str:
    """Connect from the host, bound to ``source`` (one of the bridge's addresses)."""
    s = socket.socket()
    s.settimeout(3)
    try:
        s.bind((source, 0))
        s.connect((host, port))
        if send is not None:
            s.sendall(send)
            s.shutdown(socket.SHUT_WR)
        return "connected"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()


def test_a_kernel_reaches_no_other_node_nor_the_managers_api(on_a, rig: Rig, served):
    c, sid = on_a
    b = rig.node("b")
    lo, hi = rig.port_range
    # A listener in node B's kernel port range, which the gateway can reach (the control). It
    # takes the highest free port: B's kernels hold random ports of the same range.
    probe = b.popen(sys.executable, "-c",
                    "import socket,time\n"
                    f"for port in range({hi}, {lo}, -1):\n"
                    "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                    "    try:\n"
                    f"        s.bind(({b.address!r}, port)); break\n"
                    "    except OSError:\n"
                    "        s.close()\n"
                    "s.listen(4); print(port, flush=True); time.sleep(300)",
                    stdout=__import__("subprocess").PIPE)
    try:
        assert probe.stdout is not None
        port_b = int(probe.stdout.readline())
        assert connect_from(rig.gateway_address, b.address, port_b) == "connected"
        # ... and that node A's kernel cannot: nor B's sshd.
        for port in (port_b, 22):
            r = run(c, sid, PROBE.format(host=b.address, port=port))
            assert r["status"] == "ok" and r["result"] != "'connected'", (port, r)
    finally:
        probe.kill()
        probe.wait()
    # The manager's API port, on the bridge's addresses (listeners the test opens there).
    api_port = int(served.url.rsplit(":", 1)[1])
    for address in (rig.gateway_address, rig.other_address):
        with listener(address, api_port) as s:
            r = run(c, sid, PROBE.format(host=address, port=api_port))
            assert r["status"] == "ok" and r["result"] != "'connected'", (address, r)
            assert not accepted(s)


def test_routes_end_at_the_test_subnet_and_the_firewall_is_out_of_reach(on_a, rig: Rig):
    c, sid = on_a
    r = run(c, sid, "[l.split()[1] for l in open('/proc/net/route').read().splitlines()[1:]]")
    destinations = json.loads(r["result"].replace("'", '"'))
    assert destinations == ["00" + "".join(f"{int(x):02X}" for x in reversed(rig.subnet.split("/")[0].split(".")[:3]))], r
    # No default route (destination 00000000), nothing beyond the subnet; IPv6 is link-local only.
    r = run(c, sid, "[l.split()[0][:4] for l in open('/proc/net/ipv6_route').read().splitlines()]")
    assert set(json.loads(r["result"].replace("'", '"'))) <= {"fe80", "ff00", "0000"}, r
    # The kernel is no one on the host: an unprivileged uid, no capabilities.
    r = run(c, sid, "[l.split()[1] for l in open('/proc/self/status').read().splitlines() if l.startswith('CapEff')]")
    assert r["result"] == "['0000000000000000']", r
    # Seen from the host, every sandbox process on the node runs as an unprivileged uid.
    uids = {}
    for pid in rig.node("a").pids():
        with contextlib.suppress(OSError):
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()  # noqa: SIM115
            if b"bwrap" in cmd or b"ipykernel" in cmd:
                status = open(f"/proc/{pid}/status").read()  # noqa: SIM115
                uids[pid] = {int(u) for line in status.splitlines() if line.startswith(("Uid:", "Gid:"))
                             for u in line.split()[1:]}
    assert uids and all(min(u) >= 310_000 for u in uids.values()), uids
    # It cannot change the node's rules ...
    r = run(c, sid, "import subprocess\np = subprocess.run(['/usr/sbin/nft', 'flush', 'ruleset'], capture_output=True)\n"
                    "p.returncode")
    assert r["status"] == "ok" and r["result"] != "0", r
    # ... which are in place: policy drop both ways, SSH and kernel ports from the gateway only.
    rules = rig.node("a").exec("nft", "list", "table", "inet", "kmnode").stdout
    assert rules.count("policy drop") == 2, rules
    assert f"ip saddr {rig.gateway_address} tcp dport 22 accept" in rules, rules
    assert f"ip daddr {rig.gateway_address} tcp dport {rig.response_port} accept" in rules, rules


def test_kernel_values_that_would_inject_do_not_run_on_the_node(eg, rig: Rig):
    marker = rig.root / "injected"
    values = [f"a$(touch {marker})b", f'x";touch {marker};"', f"`touch {marker}`", f"y'; touch {marker}; '"]
    env = {"KERNEL_USERNAME": "alice", **{f"KERNEL_INJECT_{i}": v for i, v in enumerate(values)}}
    r = eg.request("POST", "/api/kernels", json={"name": KERNEL_NAME, "env": env})
    assert r.status_code == 201, r.text  # the values travel quoted: the kernel starts ...
    kernel = r.json()["id"]
    try:
        assert not marker.exists()  # ... and nothing in them ran on the node
        # The launcher's log on the node holds no connection payload (its HMAC key): level 30.
        log = (rig.root / "logs" / f"kernel-{kernel}.log").read_text()
        assert '"key"' not in log and "Payload" not in log, log[-2000:]
    finally:
        eg.request("DELETE", f"/api/kernels/{kernel}")
    # A start with no KERNEL_USERNAME is refused (EG would use its own user).
    r = eg.request("POST", "/api/kernels", json={"name": KERNEL_NAME, "env": {}})
    assert r.status_code == 403 and "KERNEL_USERNAME" in r.text, r.text


def test_the_launchers_signal_port_answers_the_gateway_only(on_a, rig: Rig):
    c, sid = on_a
    r = run(c, sid, COMM_PORT)
    lo, hi = rig.port_range
    ports = json.loads(r["result"])
    assert len(ports) == 1 and lo <= ports[0] <= hi, r
    comm, a = ports[0], rig.node("a").address
    # From node B (as root there: its firewall is the node's, not the kernel's) ...
    b = rig.node("b").exec(sys.executable, "-c", f"""
import socket
s = socket.socket(); s.settimeout(3)
try:
    s.connect(({a!r}, {comm})); print('connected')
except OSError as e:
    print(type(e).__name__)
""")
    assert b.stdout.strip() != "connected", b.stdout
    # ... and from the host's other address on the bridge: nothing.
    assert connect_from(rig.other_address, a, comm) != "connected"
    # From the gateway's address it answers (a harmless signal 0, as EG's own poll sends).
    assert connect_from(rig.gateway_address, a, comm, send=b'{"signum": 0}') == "connected"
    assert run(c, sid, "1 + 1")["result"] == "2"
