"""Config-time patches for Enterprise Gateway 3.3.0, applied by EG's config file (so they run
inside EG's own virtualenv, before EG serves anything): the Kubernetes image's
(deploy/kubernetes/images/enterprise-gateway/Dockerfile) and the test rig's (tests/support/cluster/eg.py).
Each fixes a fault measured on this kind of machine (../shared/GATEWAY-NOTES.md, "Enterprise
Gateway"); the SSH ones matter only to DistributedProcessProxy, the rest to every process proxy:

- ``KERNEL_*`` values are pasted into an ``export K="v";`` shell line for SSH, where
  ``a$(id > FILE)b`` runs as root on the node: every value is ``shlex.quote``d instead (fixed on
  EG's main, commit 83f54a88, not released);
- a kernel start without ``KERNEL_USERNAME`` is refused (403): EG would fall back to its own
  user, and the rig's kernels are always someone's;
- Nagle on the kernel websocket (+40 ms a round trip): ``set_nodelay(True)``;
- the response socket blocks in ``accept()`` 5 ms at a time on the event loop after the first
  remote launch: made non-blocking;
- paramiko connects without a timeout, on the event loop (a blackholed node froze the whole
  gateway for minutes): every SSH connect gets one.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

SSH_CONNECT_TIMEOUT = 3.0


def _quoted_startup_command(self: Any, argv_cmd: list[str], **kwargs: Any) -> str:
    """EG's DistributedProcessProxy._build_startup_command with every env value quoted."""
    import os

    from enterprise_gateway.services.processproxies import distributed
    from enterprise_gateway.services.processproxies.processproxy import BaseProcessProxyABC

    env_dict = kwargs["env"]
    kid = env_dict.get("KERNEL_ID")
    self.kernel_log = os.path.join(distributed.kernel_log_dir, f"kernel-{kid}.log")
    if BaseProcessProxyABC.ip_is_local(self.ip):
        return argv_cmd  # type: ignore[return-value]  # EG's local shortcut, unchanged
    cmd = ""
    for key, value in [*env_dict.items(), *self.kernel_manager.kernel_spec.env.items()]:
        if not key.replace("_", "").isalnum():
            raise ValueError(f"refused environment variable name {key!r}")
        cmd += f"export {key}={shlex.quote(str(value))};"
    cmd += "nohup " + " ".join(argv_cmd)
    cmd += f" >> {shlex.quote(self.kernel_log)} 2>&1 & echo $!"
    return cmd


def apply() -> None:
    """Install every patch (idempotent)."""
    import paramiko
    import tornado.web
    from enterprise_gateway.services.kernels import handlers
    from enterprise_gateway.services.processproxies import distributed, processproxy

    distributed.DistributedProcessProxy._build_startup_command = _quoted_startup_command

    post = handlers.MainKernelHandler.post
    if not getattr(post, "_kernelmode", False):
        async def checked_post(self: Any) -> None:
            model = self.get_json_body() or {}
            env = model.get("env") if isinstance(model, dict) else None
            if not isinstance(env, dict) or not env.get("KERNEL_USERNAME"):
                raise tornado.web.HTTPError(403, "KERNEL_USERNAME is required")
            await post(self)

        checked_post._kernelmode = True  # type: ignore[attr-defined]
        handlers.MainKernelHandler.post = checked_post

    opened = handlers.ZMQChannelsHandler.open
    if not getattr(opened, "_kernelmode", False):
        def open_nodelay(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.set_nodelay(True)
            return opened(self, *args, **kwargs)

        open_nodelay._kernelmode = True  # type: ignore[attr-defined]
        handlers.ZMQChannelsHandler.open = open_nodelay

    prepare = processproxy.ResponseManager._prepare_response_socket
    if not getattr(prepare, "_kernelmode", False):
        def prepare_nonblocking(self: Any) -> None:
            prepare(self)
            self._response_socket.setblocking(False)

        prepare_nonblocking._kernelmode = True  # type: ignore[attr-defined]
        processproxy.ResponseManager._prepare_response_socket = prepare_nonblocking

    connect = paramiko.SSHClient.connect
    if not getattr(connect, "_kernelmode", False):
        def connect_with_timeout(self: Any, *args: Any, **kwargs: Any) -> Any:
            for key in ("timeout", "banner_timeout", "auth_timeout", "channel_timeout"):
                kwargs[key] = kwargs.get(key) or SSH_CONNECT_TIMEOUT
            return connect(self, *args, **kwargs)

        connect_with_timeout._kernelmode = True  # type: ignore[attr-defined]
        paramiko.SSHClient.connect = connect_with_timeout


def config_lines(settings: dict[str, Any]) -> str:
    """An EG config file (Python) that applies the patches and sets ``settings`` (trait ->
    value) on EnterpriseGatewayApp."""
    lines = ["import sys", f"sys.path.insert(0, {json.dumps(str(__file__.rsplit('/', 1)[0]))})",
             "import eg_patches", "eg_patches.apply()", "c = get_config()  # noqa: F821"]
    lines += [f"c.EnterpriseGatewayApp.{k} = {v!r}" for k, v in settings.items()]
    return "\n".join(lines) + "\n"
