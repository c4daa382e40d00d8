"""The kernels' IPython config (kernel-image/ipython_kernel_config.json) reaches a kernel through the
kernel environment itself, with no option on the kernel's command line: the way Enterprise Gateway's
launchers start kernels (tests/cluster checks a node's kernel; check_launcher.py the pod image's).

A real venv (this one's packages through a .pth), `kernelmode setup`'s quick path on it, a real
ipykernel started from it with a bare ``-f`` command line."""

from __future__ import annotations

import json
import os
import site
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from kernelmode.setup_env import IPYTHON_CONFIG, STAMP, _fingerprint, build_kernel_env

ASK = ("import json, sys; hm = get_ipython().history_manager\n"
       "print(json.dumps([sys.prefix, str(hm.hist_file), hm.save_thread is not None]))")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv whose site-packages reach this venv's (ipykernel), stamped up to date."""
    target = tmp_path_factory.mktemp("kenv") / "venv"
    venv.create(target, with_pip=False)
    purelib = next(Path(target / "lib").glob("python3*/site-packages"))
    (purelib / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    yield target


def history_of(python: Path, home: Path) -> tuple[str, bool]:
    """(hist_file, whether the history thread runs) in a kernel started with no IPython options."""
    spec = home / "kernels" / "probe"
    spec.mkdir(parents=True)  # `home` is the kernel's cwd too
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "probe", "language": "python"}))
    km = KernelManager(kernel_name="probe", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(home / "kernels")]))
    # As the sandbox sets it (kernelmode/sandbox/base.py): a private HOME and IPYTHONDIR.
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "IPYTHONDIR": str(home / ".ipython")}
    km.start_kernel(env=env, cwd=str(home))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        out: list[str] = []
        reply = kc.execute_interactive(ASK, timeout=60, output_hook=lambda m: out.append(
            m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
        assert reply["content"]["status"] == "ok", reply
        prefix, hist_file, thread = json.loads("".join(out))
        assert prefix == str(python.parent.parent), prefix  # this venv's kernel
        return str(hist_file), bool(thread)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_the_shipped_config_is_the_kernel_images(tmp_path: Path) -> None:
    assert IPYTHON_CONFIG.read_bytes() == (REPO / "kernel-image" / "ipython_kernel_config.json").read_bytes()
    assert json.loads(IPYTHON_CONFIG.read_text()) == {"HistoryManager": {"hist_file": ":memory:"}}


def test_setup_puts_the_config_in_the_venv_and_a_bare_kernel_reads_it(kernel_env: Path, tmp_path: Path) -> None:
    python = kernel_env / "bin" / "python"
    # Without the file: IPython's default, a sqlite file written by a thread after every cell.
    hist_file, thread = history_of(python, tmp_path / "before")
    assert hist_file.endswith("history.sqlite") and thread
    # `kernelmode setup` on an environment that is up to date (its quick path) still writes it.
    req = tmp_path / "requirements.txt"
    req.write_text("ipykernel\n")
    (kernel_env / STAMP).write_text(_fingerprint(req, "/usr/bin/python3") + "\n")
    said: list[str] = []
    assert build_kernel_env(kernel_env, python="/usr/bin/python3", requirements=req, say=said.append) == python
    assert "up to date" in said[-1]
    installed = kernel_env / "etc" / "ipython" / "ipython_kernel_config.json"
    assert installed.read_bytes() == IPYTHON_CONFIG.read_bytes()
    assert installed.stat().st_mode & 0o777 == 0o644
    # A config file in the kernel's working directory (the workspace) configures nothing.
    (tmp_path / "after").mkdir()
    for name in ("ipython_kernel_config.json", "ipython_config.json"):
        (tmp_path / "after" / name).write_text('{"HistoryManager": {"hist_file": "workspace.sqlite"}}')
    assert history_of(python, tmp_path / "after") == (":memory:", False)
