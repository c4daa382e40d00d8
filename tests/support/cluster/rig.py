"""Two simulated nodes for Enterprise Gateway: network namespaces on a host bridge, an sshd in
each, nftables locking each node to the gateway's address.

``python -m tests.support.cluster.rig up|down [SLOT]`` does the same by hand. A rig is a *slot*: slot 0
is ``kmnode-a``/``kmnode-b`` on 10.247.19.0/24 behind bridge ``kmbr0``; a second rig on the
same machine (another engineer's run) takes slot 1 (``kmnode1-a``..., 10.247.20.0/24). A slot
is claimed by creating its first namespace (``ip netns add`` fails if it exists), so two runs
never share one. ``down`` kills every process in the namespaces, deletes them, the bridge and
the rig directory: nothing is left behind.

Per node (``inet`` table, so IPv6 is covered too): input drop except ``lo``, established, and
from the gateway's address TCP 22 and the kernel port range; output drop except ``lo``,
established, and to the gateway's address its response port and the egress proxy's port (the
only way out of a node's kernel: `kernelmode egress-proxy` on the gateway's address).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

IP = shutil.which("ip") or "/usr/sbin/ip"
NFT = shutil.which("nft") or "/usr/sbin/nft"
SSHD = "/usr/sbin/sshd"
MAX_SLOTS = 8


class RigUnavailable(RuntimeError):
    """The machine lacks something the rig needs (root, sshd, nft, network namespaces)."""


def _run(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def missing() -> str | None:
    """Why the rig cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the cluster rig needs root (network namespaces, sshd, nftables)"
    for tool in (IP, NFT, SSHD, shutil.which("ssh-keygen") or "", shutil.which("bwrap") or "",
                 shutil.which("setpriv") or ""):
        if not tool or not os.path.exists(tool):
            return f"{tool or 'a tool'} is missing: run `make setup-cluster`"
    return None


@dataclass
class Node:
    name: str  # "a" or "b"
    netns: str
    address: str
    veth: str  # the host end, in the bridge
    sshd_pid: int = 0

    def exec(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this node's network namespace (as root, the rig's own probes)."""
        return _run(IP, "netns", "exec", self.netns, *argv, check=check)

    def popen(self, *argv: str, **kw: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen([IP, "netns", "exec", self.netns, *argv], **kw)  # type: ignore[call-overload]

    def pids(self) -> list[int]:
        r = _run(IP, "netns", "pids", self.netns, check=False)
        return [int(p) for p in r.stdout.split()]


@dataclass
class Rig:
    slot: int
    root: Path  # keys, sshd configs, node workspaces, kernel logs
    bridge: str
    gateway_address: str  # the gateway's side of the bridge (EG_RESPONSE_IP, source of SSH)
    other_address: str  # a second host address on the bridge: "the host's other addresses"
    prefix: int
    port_range: tuple[int, int]  # the kernels' ports on the nodes (EG's port_range)
    response_port: int  # EG's response port on gateway_address
    egress_port: int  # `kernelmode egress-proxy` on gateway_address (test_egress_remote.py)
    nodes: list[Node] = field(default_factory=list)

    @property
    def subnet(self) -> str:
        return self.gateway_address.rsplit(".", 1)[0] + ".0/24"

    @property
    def ssh_dir(self) -> Path:
        """The gateway's ``$HOME/.ssh``: its key and a pre-filled known_hosts."""
        return self.root / "eg-home" / ".ssh"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def node_of(self, address: str) -> Node | None:
        return next((n for n in self.nodes if n.address == address), None)

    # -- up ----------------------------------------------------------------------------------
    def _addresses(self) -> None:
        _run(IP, "link", "add", self.bridge, "type", "bridge")
        _run(IP, "addr", "add", f"{self.gateway_address}/{self.prefix}", "dev", self.bridge)
        _run(IP, "addr", "add", f"{self.other_address}/{self.prefix}", "dev", self.bridge)
        _run(IP, "link", "set", self.bridge, "up")
        for n in self.nodes:
            if n.name != "a":  # node a's namespace was made when the slot was claimed
                _run(IP, "netns", "add", n.netns)
            _run(IP, "link", "add", n.veth, "type", "veth", "peer", "name", "eth0", "netns", n.netns)
            _run(IP, "link", "set", n.veth, "master", self.bridge)
            _run(IP, "link", "set", n.veth, "up")
            n.exec(IP, "link", "set", "lo", "up")
            n.exec(IP, "addr", "add", f"{n.address}/{self.prefix}", "dev", "eth0")
            n.exec(IP, "link", "set", "eth0", "up")

    def nft_rules(self, node: Node) -> str:
        """The node's ruleset (nft syntax), one ``inet`` table."""
        lo, hi = self.port_range
        gw = self.gateway_address
        return f"""table inet kmnode {{
    chain input {{
        type filter hook input priority 0; policy drop;
        iif "lo" accept
        ct state established,related accept
        ip saddr {gw} tcp dport 22 accept
        ip saddr {gw} tcp dport {lo}-{hi} accept
    }}
    chain output {{
        type filter hook output priority 0; policy drop;
        oif "lo" accept
        ct state established,related accept
        ip daddr {gw} tcp dport {self.response_port} accept
        ip daddr {gw} tcp dport {self.egress_port} accept
    }}
}}
"""

    def _firewall(self) -> None:
        for n in self.nodes:
            _run(IP, "netns", "exec", n.netns, NFT, "-f", "-", input=self.nft_rules(n))

    def _keys(self) -> None:
        self.ssh_dir.mkdir(parents=True, mode=0o700)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.ssh_dir / "id_ed25519"))
        known = []
        for n in self.nodes:
            d = self.root / f"node-{n.name}"
            (d / "sshd").mkdir(parents=True, mode=0o700)
            key = d / "sshd" / "host_ed25519"
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
            known.append(f"{n.address} {key.with_suffix('.pub').read_text().split(' ')[0]} "
                         f"{key.with_suffix('.pub').read_text().split(' ')[1]}")
            (d / "sshd" / "authorized_keys").write_text((self.ssh_dir / "id_ed25519.pub").read_text())
        (self.ssh_dir / "known_hosts").write_text("\n".join(known) + "\n")

    def _sshd(self) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        for n in self.nodes:
            d = self.root / f"node-{n.name}" / "sshd"
            cfg = d / "sshd_config"
            cfg.write_text(
                f"ListenAddress {n.address}:22\n"
                f"HostKey {d / 'host_ed25519'}\n"
                f"PidFile {d / 'sshd.pid'}\n"
                f"AuthorizedKeysFile {d / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPrintMotd no\n"
                "X11Forwarding no\nAllowTcpForwarding no\nAllowAgentForwarding no\n"
                "MaxStartups 100:30:200\n")
            n.exec(SSHD, "-f", str(cfg))
            n.sshd_pid = _wait_for_pid(d / "sshd.pid", f"sshd on node {n.name}")

    def up(self) -> Rig:
        """Bring the nodes up (the slot is already claimed); on any failure, ``down``."""
        try:
            self.root.mkdir(mode=0o755, exist_ok=True)
            for n in self.nodes:
                for sub in ("workspaces", "kernels", "logs"):
                    (self.root / f"node-{n.name}" / sub).mkdir(parents=True, exist_ok=True)
            self._addresses()
            self._firewall()
            self._keys()
            self._sshd()
        except BaseException:
            self.down()
            raise
        return self

    # -- down --------------------------------------------------------------------------------
    def kill_node(self, node: Node) -> int:
        """Kill every process in the node's namespace (sshd, launchers, kernels); how many."""
        pids = node.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def down(self) -> None:
        """Remove everything of this slot; safe to call twice or on a half-built rig."""
        for n in self.nodes:
            for _ in range(3):
                if not self.kill_node(n):
                    break
                time.sleep(0.1)
            _run(IP, "netns", "del", n.netns, check=False)
            _run(IP, "link", "del", n.veth, check=False)
        _run(IP, "link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def _wait_for_pid(path: Path, what: str, timeout: float = 20.0) -> int:
    """The pid sshd writes once it listens. The file appears before its contents (sshd creates,
    then writes), so an empty or partial read means "not yet", not an error."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError):
            text = path.read_text()
            if text.endswith("\n"):
                return int(text)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (no pid in {path} after {timeout:.0f} s)")
        time.sleep(0.05)


def describe(slot: int) -> Rig:
    """The names, addresses and ports of one slot (nothing is created)."""
    suffix = "" if slot == 0 else str(slot)
    net = f"10.247.{19 + slot}"
    rig = Rig(slot=slot, root=Path(f"/tmp/kmrig{suffix or '0'}"), bridge=f"kmbr{slot}",
              gateway_address=f"{net}.1", other_address=f"{net}.2", prefix=24,
              port_range=(41000 + 1000 * slot, 41000 + 1000 * slot + 1000),  # EG: hi - lo >= 1000
              response_port=18877 + slot, egress_port=13128 + slot)
    rig.nodes = [Node(name, f"kmnode{suffix}-{name}", f"{net}.{11 + i}", f"kmv{slot}{name}")
                 for i, name in enumerate(("a", "b"))]
    return rig


def _subnet_taken(rig: Rig) -> bool:
    """Whether the host already has an address or route in the slot's subnet (not ours)."""
    out = _run(IP, "-4", "route", "show", check=False).stdout + _run(IP, "-4", "addr", check=False).stdout
    return rig.gateway_address.rsplit(".", 1)[0] + "." in out


def claim(slot: int | None = None) -> Rig:
    """Claim a free slot (or ``slot``) and bring its rig up."""
    why = missing()
    if why:
        raise RigUnavailable(why)
    for s in ([slot] if slot is not None else range(MAX_SLOTS)):
        rig = describe(s)
        if _subnet_taken(rig):
            continue
        if _run(IP, "netns", "add", rig.nodes[0].netns, check=False).returncode != 0:
            continue  # another run holds this slot
        return rig.up()
    raise RigUnavailable("no free rig slot (another run holds them all)")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("up", "down"):
        print("usage: python -m tests.support.cluster.rig up|down [SLOT]", file=sys.stderr)
        return 2
    slot = int(argv[2]) if len(argv) > 2 else None
    if argv[1] == "up":
        rig = claim(slot)
        print(f"slot {rig.slot}: gateway {rig.gateway_address}, nodes "
              + ", ".join(f"{n.netns}={n.address}" for n in rig.nodes))
    else:
        describe(slot or 0).down()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
