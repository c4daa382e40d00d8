"""Network: a kernel has its own network namespace with only `lo`, and reaches nothing of the host.

No traffic is ever aimed at anything but loopback: name resolution must fail inside the sandbox
without a resolver to ask, and every connect() targets 127.0.0.1 / ::1 / abstract unix sockets.
"""

from __future__ import annotations

import os
import socket
import textwrap
from urllib.parse import urlparse

from .conftest import gateway_port


def test_only_loopback_interface_and_no_routes(shared_sid, probe):
    r = probe(shared_sid, """
        import socket
        dev = [l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]]
        routes = open('/proc/net/route').read().splitlines()[1:]
        routes6 = [l for l in open('/proc/net/ipv6_route').read().splitlines()
                   if not l.endswith(' lo')]
        print(_json.dumps({"ifaces": [n for _, n in socket.if_nameindex()], "dev": dev,
                           "routes": routes, "routes6": routes6,
                           "resolv": _os.path.exists('/etc/resolv.conf') and open('/etc/resolv.conf').read()}))
    """)
    assert r["ifaces"] == ["lo"]
    assert r["dev"] == ["lo"]
    assert r["routes"] == []
    assert r["routes6"] == []
    assert r["resolv"] in (False, "")  # no name server configured (docker: an empty file)


def test_dns_resolution_fails(shared_sid, probe):
    # Only resolve when the namespace is verified to have nothing but `lo`: even a broken
    # sandbox then cannot send the query off the machine.
    r = probe(shared_sid, """
        import socket
        out = {"ifaces": [n for _, n in socket.if_nameindex()]}
        if out["ifaces"] == ["lo"]:
            for name in ("localhost.example", "pypi.org"):
                try:
                    out[name] = ["resolved", socket.getaddrinfo(name, 443)[0][4][0]]
                except socket.gaierror as e:
                    out[name] = ["gaierror", e.errno]
                except OSError as e:
                    out[name] = ["oserror", _err(e)]
        print(_json.dumps(out))
    """)
    assert r["ifaces"] == ["lo"]
    assert r["localhost.example"][0] == "gaierror"
    assert r["pypi.org"][0] == "gaierror"


CONNECT = textwrap.dedent("""
    import socket
    out = {}
    for key, family, addr in TARGETS:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(3)
        try:
            s.connect(tuple(addr) if family != socket.AF_UNIX else addr)
            out[key] = "connected"
        except OSError as e:
            out[key] = _err(e)
        finally:
            s.close()
    print(_json.dumps(out))
""")


def test_host_loopback_listener_unreachable(server, shared_sid, probe):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    abstract = f"\0kmtest-{os.urandom(6).hex()}"
    ulistener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ulistener.bind(abstract)
    ulistener.listen(8)
    targets = [
        ("tcp4", socket.AF_INET, ["127.0.0.1", port]),
        ("tcp6", socket.AF_INET6, ["::1", port, 0, 0]),
        ("abstract_unix", socket.AF_UNIX, abstract),
    ]
    try:
        code = f"TARGETS = [{', '.join(f'({k!r}, {int(f)}, {a!r})' for k, f, a in targets)}]\n"
        r = probe(shared_sid, code + CONNECT)
        assert r["tcp4"] == "ECONNREFUSED", r
        assert r["tcp6"] != "connected", r
        assert r["abstract_unix"] == "ECONNREFUSED", r
        for sock in (listener, ulistener):
            sock.settimeout(0.5)
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            conn.close()
            raise AssertionError("a sandboxed kernel connected to a host listener")
    finally:
        listener.close()
        ulistener.close()


def test_manager_and_gateway_ports_unreachable(server, shared_sid, probe):
    ports = {"manager": urlparse(server.url).port}
    gw = gateway_port(server)
    if gw is not None:
        ports["gateway"] = gw
    code = "TARGETS = " + repr([(k, int(socket.AF_INET), ["127.0.0.1", p]) for k, p in ports.items()])
    r = probe(shared_sid, code + "\n" + CONNECT)
    assert set(r) == set(ports)
    assert all(v == "ECONNREFUSED" for v in r.values()), r


def test_raw_and_packet_sockets_refused(shared_sid, probe):
    r = probe(shared_sid, """
        import socket
        out = {}
        for key, args in {"raw_icmp": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
                          "raw_tcp": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP),
                          "packet": (socket.AF_PACKET, socket.SOCK_RAW, 0x0300)}.items():
            try:
                socket.socket(*args).close()
                out[key] = "ok"
            except OSError as e:
                out[key] = [type(e).__name__, _err(e)]
        print(_json.dumps(out))
    """)
    for key in ("raw_icmp", "raw_tcp", "packet"):
        assert r[key] == ["PermissionError", "EPERM"], r


def test_session_still_usable(shared_sid, run):
    res = run(shared_sid, "1 + 1")
    assert res["status"] == "ok" and res["result"] == "2"
