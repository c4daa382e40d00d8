"""The seccomp filter: kernel code cannot ptrace (the sandbox's pid 1 included), read or write
other processes' memory, or reach perf, bpf, userfaultfd, io_uring or the keyring; the 32-bit
ABI is closed; ordinary analysis work still runs. Both backends (KM_TEST_BACKEND=docker too)."""

from __future__ import annotations

import json
import platform

import pytest

from kernelmode.sandbox import seccomp

x86_64_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 syscall numbers")

# Each call with arguments that succeed (or fail otherwise than EPERM/ENOSYS) without a filter.
SYSCALLS = """
import ctypes, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
def sys_call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return "ok" if r >= 0 else _errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
buf = ctypes.create_string_buffer(64)
attr = ctypes.create_string_buffer(128)  # perf_event_attr / bpf_attr, zeroed
ctypes.c_uint32.from_buffer(attr, 4).value = 128  # perf_event_attr.size
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)  # one struct iovec
out = {
    "ptrace_attach_pid1": sys_call(101, 16, 1, 0, 0),  # PTRACE_ATTACH
    "process_vm_readv_pid1": sys_call(310, 1, ctypes.addressof(iov), 1, ctypes.addressof(iov), 1, 0),
    "process_vm_writev_pid1": sys_call(311, 1, ctypes.addressof(iov), 1, ctypes.addressof(iov), 1, 0),
    "perf_event_open": sys_call(298, ctypes.addressof(attr), 0, -1, -1, 0),
    "bpf_map_create": sys_call(321, 0, ctypes.addressof(attr), 72),
    "userfaultfd": sys_call(323, 0),
    "keyctl_get_session_keyring": sys_call(250, 0, -3, 1),  # KEYCTL_GET_KEYRING_ID, create
    "add_key": sys_call(248, ctypes.addressof(ctypes.create_string_buffer(b"user")),
                        ctypes.addressof(ctypes.create_string_buffer(b"km")), ctypes.addressof(buf), 4, -2),
    "request_key": sys_call(249, ctypes.addressof(ctypes.create_string_buffer(b"user")),
                            ctypes.addressof(ctypes.create_string_buffer(b"km")), 0, -2),
    "io_uring_setup": sys_call(425, 1, ctypes.addressof(attr)),
    "kcmp_pid1": sys_call(312, 1, _os.getpid(), 0, 0, 0),
}
# PTRACE_TRACEME in a child of its own (it would make the kernel traceable by its parent).
child = subprocess.run([sys.executable, "-c",
    "import ctypes, errno; libc = ctypes.CDLL(None, use_errno=True); "
    "r = libc.ptrace(0, 0, 0, 0); print('ok' if r == 0 else errno.errorcode[ctypes.get_errno()])"],
    capture_output=True, text=True)
out["ptrace_traceme"] = child.stdout.strip() or child.stderr[-200:]
status = dict(l.split(":", 1) for l in open('/proc/self/status') if ":" in l)
out["seccomp_mode"] = status["Seccomp"].strip()
print(_json.dumps(out))
"""

# `mov eax, 20 (getpid); int 0x80; ret` in an executable page: a 32-bit syscall from 64-bit code.
INT80 = r"""
import subprocess, sys
code = '''
import ctypes, mmap
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(bytes([0xb8, 20, 0, 0, 0, 0xcd, 0x80, 0xc3]))
f = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
print(f(), flush=True)
'''
p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
print(_json.dumps({"returncode": p.returncode, "stdout": p.stdout.strip(), "stderr": p.stderr[-300:]}))
"""

NORMAL_WORK = """
import subprocess, threading, concurrent.futures
import numpy as np, pandas as pd
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
a = np.random.default_rng(0).normal(size=(200, 200))
df = pd.DataFrame({"x": range(100), "y": [i * i for i in range(100)]})
fig, ax = plt.subplots()
ax.plot(df.x, df.y)
fig.savefig("/mnt/data/seccomp-plot.png")
with concurrent.futures.ThreadPoolExecutor(4) as ex:
    sums = list(ex.map(lambda i: float(a[i].sum()), range(8)))
sub = subprocess.run(["python", "-c", "import os; print(os.getpid() > 1)"], capture_output=True, text=True)
sh = subprocess.run("echo piped | tr a-z A-Z", shell=True, capture_output=True, text=True)
print(_json.dumps({
    "inv": float(np.linalg.inv(a @ a.T + np.eye(200)).trace()) > 0,
    "mean": float(df.y.mean()), "png": _os.path.getsize("/mnt/data/seccomp-plot.png") > 1000,
    "threads": len(sums), "sub": sub.stdout.strip(), "sh": sh.stdout.strip(),
}))
"""


@x86_64_only
def test_ptrace_and_kernel_attack_surface_refused(shared_sid, probe):
    r = probe(shared_sid, SYSCALLS)
    assert r.pop("seccomp_mode") == "2", r  # a filter is in force
    refused = {k: v for k, v in r.items() if v in ("EPERM", "ENOSYS")}
    assert refused == r, f"allowed or failing otherwise: { {k: v for k, v in r.items() if k not in refused} }"


@x86_64_only
def test_32_bit_syscall_abi_closed(shared_sid, probe):
    r = probe(shared_sid, INT80)
    # Refused: the process is killed (SIGSYS) or the call returns an error; never a pid.
    killed = r["returncode"] < 0
    refused = r["returncode"] == 0 and r["stdout"].lstrip("-").isdigit() and int(r["stdout"]) < 0
    assert killed or refused, r


def test_normal_work_still_runs(session_factory, probe):
    r = probe(session_factory(), NORMAL_WORK, timeout_seconds=120)
    assert r == {"inv": True, "mean": 3283.5, "png": True, "threads": 8, "sub": "True", "sh": "PIPED"}, r


# -- the profile itself (no server) ----------------------------------------------------------

def test_profile_is_dockers_default_less_the_denials():
    upstream = json.loads(seccomp.UPSTREAM.read_text())
    ours = seccomp.profile()
    allowed = {n for rule in ours["syscalls"] for n in rule["names"]}
    assert not allowed & seccomp.DENIED
    assert {"ptrace", "process_vm_readv", "perf_event_open", "bpf", "keyctl"} <= seccomp.DENIED
    # Everything else Docker's default names is still there, rule for rule.
    theirs = {n for rule in upstream["syscalls"] for n in rule["names"]} - seccomp.DENIED
    assert allowed == theirs
    assert ours["defaultAction"] == upstream["defaultAction"] == "SCMP_ACT_ERRNO"
    assert all(not a["subArchitectures"] for a in ours["archMap"])  # native ABI only


def test_compiled_filter_is_classic_bpf():
    prog = seccomp.compile_bpf()
    assert prog and len(prog) % 8 == 0  # struct sock_filter: 8 bytes an instruction
    assert len(prog) // 8 < 4096  # BPF_MAXINSNS
