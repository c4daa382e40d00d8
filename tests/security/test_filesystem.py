"""Filesystem, processes, secrets and privileges as seen from inside a kernel (and from the host)."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from tests.conftest import BACKEND, CANARY, REPO, start_server

from .conftest import host_file_in_workspace, host_kernel_procs

WRITE_PROBE = """
    out = {}
    for p in PATHS:
        try:
            with open(p, 'w') as f:
                f.write('pwned')
            out[p] = 'ok'
        except OSError as e:
            out[p] = _err(e)
    print(_json.dumps(out))
"""


def _write_probe(paths: list[str]) -> str:
    return f"PATHS = {json.dumps(paths)}\n" + WRITE_PROBE.replace("\n    ", "\n")


def test_system_paths_read_only(shared_sid, probe):
    denied = ["/pwned", "/usr/pwned", "/usr/bin/pwned", "/etc/pwned", "/etc/passwd", "/mnt/pwned",
              "/bin/pwned", "/lib/pwned", "/proc/sys/kernel/hostname", "/proc/sysrq-trigger",
              "/work/pwned"]
    r = probe(shared_sid, _write_probe(denied))
    for p in denied:
        assert r[p] in ("EROFS", "EACCES", "EPERM", "ENOENT"), (p, r[p])


def test_tmp_and_workspace_writable(server, shared_sid, probe):
    name = f"ok-{secrets.token_hex(4)}.txt"
    paths = [f"/tmp/{name}", f"/mnt/data/{name}"]
    r = probe(shared_sid, _write_probe(paths))
    assert r == {p: "ok" for p in paths}
    # The workspace is the session's own directory on the host; /tmp is private (a tmpfs).
    assert host_file_in_workspace(server, name).read_text() == "pwned"
    assert not (Path("/tmp") / name).exists()


def test_host_secrets_and_repo_invisible(server, shared_sid, probe):
    d = str(server.data_dir)
    paths = {
        "root": "/root", "shadow": "/etc/shadow", "gshadow": "/etc/gshadow", "sudoers": "/etc/sudoers",
        "ssh": "/etc/ssh", "sys": "/sys/kernel", "docker_sock": "/var/run/docker.sock",
        "repo_pyproject": str(REPO / "pyproject.toml"), "repo_pkg": str(REPO / "kernelmode"),
        "repo_tests": str(REPO / "tests"), "repo_venv": str(REPO / ".venv"),
        "repo_git": str(REPO / ".git"), "host_tmp_log": d + ".log",
        "sqlite": d + "/sessions.sqlite3", "workspaces": d + "/workspaces",
        "gateway": d + "/gateway", "state": d + "/state", "kernels": d + "/kernels",
    }
    r = probe(shared_sid, f"""
        PATHS = {json.dumps(paths)}
        out = {{k: _os.path.exists(p) for k, p in PATHS.items()}}
        try:
            out["root_listing"] = _os.listdir('/root')
        except OSError as e:
            out["root_listing"] = _err(e)
        out["repo_listing"] = sorted(_os.listdir({str(REPO)!r})) if _os.path.isdir({str(REPO)!r}) else None
        out["data_listing"] = sorted(_os.listdir({d!r}))
        print(_json.dumps(out))
    """)
    for key in paths:
        # A container image may have an /root of its own: it must not be the host's (below).
        image_own = key in ("root", "shadow", "gshadow") and BACKEND == "docker"  # the image's, not the host's
        assert r[key] is False or image_own, (key, paths[key])
    assert r["root_listing"] in ("ENOENT", "EACCES", [])
    # Only the kernel environment (read-only) may appear under the repo; nothing else of it.
    assert r["repo_listing"] in (None, [], [".kernel-venv"])
    # Of the data dir, only the per-kernel directory's parent (`run`) is there.
    assert r["data_listing"] == ["run"]


def test_no_canary_in_any_environment(shared_sid, probe, run):
    r = probe(shared_sid, """
        import glob
        out = {"os_environ": any(_CANARY in k or _CANARY in v for k, v in _os.environ.items()),
               "proc": {}, "cmdline": False}
        for d in glob.glob('/proc/[0-9]*'):
            try:
                out["proc"][d] = _CANARY.encode() in open(d + '/environ', 'rb').read()
                out["cmdline"] |= _CANARY.encode() in open(d + '/cmdline', 'rb').read()
            except OSError as e:
                out["proc"][d] = _err(e)
        out["secret_names"] = sorted(k for k in _os.environ
                                     if 'SECRET' in k or 'TOKEN' in k or k.startswith('KERNELMODE'))
        print(_json.dumps(out))
    """.replace("_CANARY", repr(CANARY)))
    assert r["os_environ"] is False
    assert r["cmdline"] is False
    assert r["secret_names"] == []
    assert "/proc/1" in r["proc"], r
    assert all(v is False for v in r["proc"].values()), r["proc"]
    # The canary is not hiding in the subprocess environment either.
    res = run(shared_sid, f"import subprocess; print({CANARY!r} in subprocess.run(['env'], "
                          "capture_output=True, text=True).stdout)")
    assert res["stdout"].strip() == "False", res


def test_no_host_process_visible(server, shared_sid, probe):
    r = probe(shared_sid, """
        import glob
        procs = {}
        for d in glob.glob('/proc/[0-9]*'):
            try:
                procs[d[6:]] = open(d + '/cmdline', 'rb').read().replace(b'\\0', b' ').decode()
            except OSError:
                pass
        print(_json.dumps({"procs": procs, "self": _os.getpid(), "ppid": _os.getppid()}))
    """)
    procs = r["procs"]
    assert 1 <= len(procs) <= 4, procs
    assert r["self"] <= (4 if BACKEND == "bwrap" else 32)  # a fresh pid namespace (docker: after its init)
    for cmd in procs.values():
        assert "kernelmode.cli" not in cmd
        assert "kernel_gateway" not in cmd and "kernelgateway" not in cmd
        assert "pytest" not in cmd
    server_pid = str(server.proc.pid)
    assert server_pid not in procs or "kernelmode" not in procs[server_pid]


def test_devices_limited(shared_sid, probe):
    r = probe(shared_sid, """
        out = {"dev": sorted(_os.listdir('/dev'))}
        for name in ('sda', 'vda', 'nvme0n1', 'mem', 'kmem', 'port', 'kmsg', 'fuse', 'net/tun', 'kvm'):
            out[name] = _os.path.exists('/dev/' + name)
        with open('/dev/null', 'w') as f:
            out["null"] = f.write('x' * 100)
        out["zero"] = len(open('/dev/zero', 'rb').read(16))
        try:
            _os.mknod('/tmp/mem', 0o20666, _os.makedev(1, 1))
            out["mknod"] = "ok"
        except OSError as e:
            out["mknod"] = _err(e)
        print(_json.dumps(out))
    """)
    for name in ("sda", "vda", "nvme0n1", "mem", "kmem", "port", "kmsg", "fuse", "net/tun", "kvm"):
        assert r[name] is False, name
    allowed = {"console", "core", "fd", "full", "mqueue", "null", "ptmx", "pts", "random", "shm",
               "stderr", "stdin", "stdout", "tty", "urandom", "zero"}
    assert set(r["dev"]) <= allowed, set(r["dev"]) - allowed
    assert r["null"] == 100 and r["zero"] == 16
    assert r["mknod"] == "EPERM"


def test_no_privileges_inside(shared_sid, probe):
    r = probe(shared_sid, """
        import ctypes, subprocess, sys
        out = {"uid": _os.getuid(), "euid": _os.geteuid(), "groups": _os.getgroups()}
        status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())
        for k in ('CapEff', 'CapPrm', 'CapBnd', 'CapAmb', 'NoNewPrivs'):
            out[k] = status[k].strip()
        for name, fn in (("setuid", lambda: _os.setuid(0)), ("setgid", lambda: _os.setgid(0)),
                         ("setgroups", lambda: _os.setgroups([0])),
                         ("chroot", lambda: _os.chroot('/tmp'))):
            try:
                fn()
                out[name] = "ok"
            except OSError as e:
                out[name] = _err(e)
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.mount(b"none", b"/mnt", b"tmpfs", 0, None)
        out["mount"] = [rc, _errno.errorcode.get(ctypes.get_errno())]
        # unshare() in a single-threaded child (the kernel itself is multithreaded).
        child = ("import ctypes, errno, json; libc = ctypes.CDLL(None, use_errno=True); r = {}\\n"
                 "for n, flag in (('user', 0x10000000), ('mount', 0x20000), ('net', 0x40000000)):\\n"
                 "    rc = libc.unshare(flag); r[n] = [rc, errno.errorcode.get(ctypes.get_errno())]\\n"
                 "print(json.dumps(r))")
        out["unshare"] = _json.loads(subprocess.run([sys.executable, '-c', child],
                                                    capture_output=True, text=True).stdout)
        print(_json.dumps(out))
    """)
    assert r["uid"] != 0 and r["euid"] != 0 and 0 not in r["groups"]
    for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb"):
        assert int(r[k], 16) == 0, (k, r[k])
    assert r["NoNewPrivs"] == "1"
    for name in ("setuid", "setgid", "setgroups", "chroot"):
        assert r[name] in ("EPERM", "EINVAL"), (name, r[name])
    assert r["mount"] == [-1, "EPERM"]
    for ns, (rc, err) in r["unshare"].items():
        assert rc == -1 and err in ("EPERM", "ENOSPC", "EINVAL"), (ns, rc, err)


def test_kernels_run_as_unprivileged_host_uids(server, shared_sid, run):
    assert run(shared_sid, "1")["status"] == "ok"  # the kernel is up
    procs = host_kernel_procs(server)
    kernels = {pid: p for pid, p in procs.items() if "ipykernel_launcher" in p["cmdline"]}
    bwraps = {pid: p for pid, p in procs.items() if p["cmdline"].split(" ", 1)[0].endswith("bwrap")}
    assert kernels and (bwraps or BACKEND == "docker"), procs  # docker: the kernel, no bwrap
    for pid, p in {**kernels, **bwraps}.items():
        assert min(p["uids"]) >= 200_000, (pid, p)
        assert min(p["gids"]) >= 200_000, (pid, p)


def test_two_servers_on_one_host_share_no_kernel_uid():
    """Each gateway used to count uids from uid_base: the first kernels of two servers on one host
    ran as the same host uid, sharing its per-uid budgets (a fork bomb in one used up the other's
    RLIMIT_NPROC). Uids are leased host-wide (sandbox/uids.py)."""
    servers = [start_server({"KERNELMODE_SESSIONS__POOL_SIZE": "1"}) for _ in range(2)]
    try:
        uids: list[set[int]] = []
        for srv in servers:
            with srv.client() as c:
                sid = c.post("/v1/sessions", json={}).json()["session_id"]
                assert c.post(f"/v1/sessions/{sid}/execute", json={"code": "1"}).json()["status"] == "ok"
            kernels = [p for p in host_kernel_procs(srv).values() if "ipykernel_launcher" in p["cmdline"]]
            assert kernels, srv.data_dir
            uids.append({u for p in kernels for u in p["uids"]})
        assert not uids[0] & uids[1], uids
    finally:
        for srv in servers:
            srv.discard()
