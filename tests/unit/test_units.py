"""Unit tests of pure pieces (no gateway): config, output collection, bwrap command line, causes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelmode.config import load_settings
from kernelmode.errors import ConfigError
from kernelmode.gateway.execution import OutputCollector, strip_ansi
from kernelmode.models import Limits
from kernelmode.sandbox.bwrap import bwrap_argv
from kernelmode.sandbox.spec import KernelParams, cause_from_exit


def test_defaults_need_no_file():
    s = load_settings(None, environ={})
    assert s.server.port == 8888 and s.sandbox.backend == "auto"
    assert s.sandbox.limits.memory_mb == 1024 and s.sandbox.limits.pids == 128


def test_unknown_key_is_named_with_line(tmp_path: Path):
    f = tmp_path / "k.yaml"
    f.write_text("server:\n  host: 0.0.0.0\n  prot: 1\n")
    with pytest.raises(ConfigError, match=r"server\.prot \(line 3\): unknown key"):
        load_settings(f, environ={})


def test_env_interpolation_and_overrides(tmp_path: Path):
    f = tmp_path / "k.yaml"
    f.write_text("server:\n  token: ${MY_TOKEN}\nsessions:\n  max_sessions: 5\n")
    s = load_settings(f, environ={"MY_TOKEN": "abc", "KERNELMODE_SESSIONS__MAX_SESSIONS": "7"})
    assert s.server.token == "abc" and s.sessions.max_sessions == 7
    with pytest.raises(ConfigError, match="MY_TOKEN"):
        load_settings(f, environ={})
    with pytest.raises(ConfigError, match="sandbox.backend"):
        load_settings(None, environ={"KERNELMODE_SANDBOX__BACKEND": "vm"})


def test_collector_caps_each_stream_and_marks_truncation():
    c = OutputCollector(max_bytes=10)
    for _ in range(3):
        c.add({"msg_type": "stream", "content": {"name": "stdout", "text": "abcdef"}})
    c.add({"msg_type": "stream", "content": {"name": "stderr", "text": "é" * 3}})
    assert c.stdout == "abcdefabcd" and c.truncated
    assert c.stderr == "ééé"


def test_collector_result_error_and_ansi():
    c = OutputCollector(max_bytes=1000)
    c.add({"msg_type": "execute_result", "content": {"data": {"text/plain": "42"}, "execution_count": 3}})
    c.add({"msg_type": "error", "content": {"ename": "E", "evalue": "v", "traceback": ["\x1b[31mline\x1b[0m"]}})
    c.add({"msg_type": "execute_reply", "content": {"status": "error", "execution_count": 3}})
    assert c.result == "42" and c.execution_count == 3 and c.reply_status == "error"
    assert c.error is not None and c.error.traceback == "line"
    assert strip_ansi("\x1b[1;32mok\x1b[0m") == "ok"


def test_bwrap_argv_isolates_everything(tmp_path: Path):
    argv = bwrap_argv(bwrap="bwrap", kernel_dir=tmp_path / "k", etc_dir=tmp_path / "etc",
                      workspace=tmp_path / "ws",
                      ro_paths=["/usr", "/opt/venv"], tmp_bytes=1 << 20, env={"A": "1"},
                      command=["python", "-m", "ipykernel_launcher"])
    for flag in ("--unshare-all", "--unshare-user", "--disable-userns", "--new-session",
                 "--die-with-parent", "--clearenv"):
        assert flag in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    assert ["--bind", str(tmp_path / "ws"), "/mnt/data"] == argv[argv.index(str(tmp_path / "ws")) - 1:][:3]
    assert "--remount-ro" in argv and argv.index("--remount-ro") > argv.index("/mnt/data")
    assert ["--ro-bind", "/opt/venv", "/opt/venv"] == argv[argv.index("/opt/venv") - 1:][:3]
    assert argv[-4:] == ["--", "python", "-m", "ipykernel_launcher"]
    assert "--share-net" not in argv
    # Binds come after the private /tmp, so a kernel environment under /tmp stays visible.
    assert argv.index("/tmp") < argv.index("/opt/venv") and argv.index("/tmp") < argv.index(str(tmp_path / "k"))



def test_bwrap_argv_binds_the_egress_dir_and_bridge_read_only(tmp_path: Path):
    argv = bwrap_argv(bwrap="bwrap", kernel_dir=tmp_path / "k", etc_dir=tmp_path / "etc",
                      workspace=tmp_path / "ws", ro_paths=[], tmp_bytes=1 << 20, env={},
                      command=["python"], egress_binds=(tmp_path / "e", tmp_path / "b.py"))
    i = argv.index(str(tmp_path / "e"))
    assert argv[i - 1:i + 5] == ["--ro-bind", str(tmp_path / "e"), "/run/kernelmode/egress",
                                 "--ro-bind", str(tmp_path / "b.py"), "/run/kernelmode/egress-bridge.py"]
    assert i < argv.index("--remount-ro")
    assert "--share-net" not in argv


@pytest.mark.parametrize("code,oom,expected", [
    (3, False, {"kind": "exit", "exit_code": 3}),
    (139, False, {"kind": "signal", "exit_code": 139, "signal": 11}),
    (-9, False, {"kind": "signal", "signal": 9}),
    (137, True, {"kind": "oom", "exit_code": 137, "signal": 9}),
    (None, False, {"kind": "unknown"}),
])
def test_cause_from_exit(code, oom, expected):
    assert cause_from_exit(code, oom).model_dump(exclude_none=True) == expected


def test_kernel_params_leave_the_kernel_env():
    env = {"PATH": "/bin", **KernelParams(Path("/w"), Limits(pids=50), "s1").to_env()}
    params = KernelParams.pop_from_env(env, Limits())
    assert env == {"PATH": "/bin"}
    assert params is not None and params.limits.pids == 50 and params.session_id == "s1"
