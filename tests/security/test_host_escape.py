"""The kernel's directory is bound read-write at its host path and owned by the kernel's uid
while it starts (then sealed: test_socket_dir.py); the gateway (root) must never follow a link
the kernel planted there when it (re)starts it (jupyter_client's secure_write unlinks the
connection file before creating it anew)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

PLANT = """
kdir = _kernel_dir()
out = {"kdir": kdir}
try:
    if MODE == 'file':  # the connection file, which root rewrites on every (re)start
        _os.unlink(kdir + '/kernel.json')
        _os.symlink(TARGET, kdir + '/kernel.json')
    else:  # every name root may create or touch in the directory: links into the decoy dir
        for name in ['kernel.json'] + ['k-%d' % i for i in range(1, 6)]:
            p = kdir + '/' + name
            if _os.path.lexists(p):
                _os.unlink(p)
            _os.symlink(TARGET + '/' + name, p)
    out["planted"] = True
except OSError as e:
    out["planted"] = _err(e)
# The generated /etc files (hosts, passwd...) sit beside the kernel's directory, out of reach.
out["etc_reachable"] = _os.path.lexists(kdir + '.etc')
print(_json.dumps(out))
"""


@pytest.fixture()
def decoy() -> Path:
    """A root-owned directory with a root-only file: what the kernel must never get to touch."""
    d = Path(tempfile.mkdtemp(prefix="km-decoy-", dir="/tmp"))
    d.chmod(0o755)
    (d / "victim").write_text("ORIGINAL")
    (d / "victim").chmod(0o600)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.getuid() != 0, reason="kernels run as separate uids only when root")
@pytest.mark.parametrize("mode", ["file", "dir"])
def test_restart_does_not_follow_kernel_planted_symlinks(server, session_factory, run, api, decoy, mode):
    from .conftest import PRELUDE, report

    sid = session_factory()
    target = str(decoy / "victim") if mode == "file" else str(decoy)
    code = f"MODE = {mode!r}\nTARGET = {target!r}\n" + PLANT
    r = report(run(sid, PRELUDE + code))
    # The directory is sealed once the kernel has bound its sockets (test_socket_dir.py): the
    # links cannot even be planted. The restart below must stay safe all the same.
    assert r["planted"] in ("EACCES", "EPERM") and r["etc_reachable"] is False, r
    api.post(f"/v1/sessions/{sid}/restart")  # any outcome: what matters is the host below
    st = decoy.stat()
    victim = decoy / "victim"
    assert (st.st_uid, st.st_gid) == (0, 0), f"root chowned {decoy} to {st.st_uid} ({r})"
    assert sorted(p.name for p in decoy.iterdir()) == ["victim"], f"root wrote into {decoy}"
    assert victim.read_text() == "ORIGINAL", f"root overwrote {victim}: {victim.read_text()!r}"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600, "root chmodded the victim"


FD_SCAN = """
import glob
mounts = {int(l.split()[0]) for l in open('/proc/self/mountinfo')}
leaks = []
for link in glob.glob('/proc/[0-9]*/fd/*'):
    try:
        target = _os.readlink(link)
        fdinfo = open(link.replace('/fd/', '/fdinfo/')).read()
    except OSError:
        continue
    mnt = [int(l.split()[1]) for l in fdinfo.splitlines() if l.startswith('mnt_id:')]
    # A path on a mount that is not in this sandbox's mount table: a host file or directory.
    if target.startswith('/') and mnt and mnt[0] not in mounts:
        leak = {"link": link, "target": target}
        try:
            with open(link, 'rb') as f:  # re-open through the magic link, as the kernel's uid
                data = f.read()
            leak["read"] = len(data)
            leak["found"] = bool(SEEK) and SEEK.encode() in data
        except OSError as e:
            leak["read"] = _err(e)
        if link.startswith('/proc/%d/' % _os.getpid()) and MARKER:
            try:
                leak["write"] = _os.write(int(link.rsplit('/', 1)[1]), MARKER.encode())
            except OSError as e:
                leak["write"] = _err(e)
        leaks.append(leak)
print(_json.dumps({"leaks": leaks}))
"""


def test_kernels_hold_no_descriptor_to_shared_host_files(server, session_factory, run):
    from .conftest import PRELUDE, report

    a, b = session_factory(), session_factory()
    marker = "KM-LEAK-MARKER-" + os.urandom(6).hex()
    ra = report(run(a, PRELUDE + f"MARKER = {marker!r}\nSEEK = ''\n" + FD_SCAN))
    rb = report(run(b, PRELUDE + f"MARKER = ''\nSEEK = {marker!r}\n" + FD_SCAN))
    gateway_log = server.data_dir / "gateway" / "gateway.log"
    assert not any(leak.get("found") for leak in rb["leaks"]), \
        "session B read what session A wrote through an inherited descriptor"
    assert marker not in gateway_log.read_text(errors="replace"), "a kernel wrote into the gateway log"
    # The only host file a kernel holds is its own log (stdout/stderr), which it cannot re-open
    # and which no other kernel holds.
    for leaks in (ra["leaks"], rb["leaks"]):
        targets = {leak["target"] for leak in leaks}
        assert len(targets) <= 1, targets
        for leak in leaks:
            assert leak["target"].startswith(f"{server.data_dir}/run/") and leak["target"].endswith(".log"), leak
            assert leak["read"] == "EACCES", leak
    assert not ({x["target"] for x in ra["leaks"]} & {x["target"] for x in rb["leaks"]})
