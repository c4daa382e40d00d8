# Kernel Gateway configuration used by `kernelmode serve` (loaded with --config).
# The manager starts the gateway with a scrubbed environment holding only the KERNELMODE_GW_*
# variables read here, so no secret of the manager's environment reaches the gateway or a kernel.
import os

c = get_config()  # type: ignore[name-defined]  # noqa: F821  (traitlets config file)
env = os.environ

# The gateway's event loop (server.event_loop), chosen here: the app makes its loop after reading
# this file. uvloop costs less CPU per message; without it, asyncio's own.
if env.get("KERNELMODE_GW_EVENT_LOOP", "asyncio") != "asyncio":
    try:
        import asyncio

        import uvloop
    except ImportError:
        pass
    else:
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

# The gateway relays the kernels' multi-MB messages too: freed, they go back to the OS (kernelmode/heap.py).
try:
    from kernelmode.heap import release_large_buffers
except ImportError:
    pass
else:
    release_large_buffers()

# Reachable only by the manager: loopback, a random port, a random token.
c.KernelGatewayApp.ip = "127.0.0.1"
c.KernelGatewayApp.port = int(env["KERNELMODE_GW_PORT"])
c.KernelGatewayApp.port_retries = 0
c.KernelGatewayApp.auth_token = env["KERNELMODE_GW_TOKEN"]
c.KernelGatewayApp.api = "kernel_gateway.jupyter_websocket"
c.JupyterWebsocketPersonality.list_kernels = True
c.KernelGatewayApp.allow_origin = ""
c.KernelGatewayApp.default_kernel_name = "kernelmode"
c.KernelGatewayApp.max_kernels = int(env.get("KERNELMODE_GW_MAX_KERNELS", "0")) or None

# Only kernelmode's kernelspec (found through JUPYTER_PATH, set by the manager): the gateway
# must never start an unsandboxed "python3" kernel, whoever asks.
c.KernelSpecManager.ensure_native_kernel = False
c.KernelSpecManager.allowed_kernelspecs = {"kernelmode"}

# Pitfall: tornado leaves Nagle on for websockets (~40 ms per exchange). Our class turns it off.
c.KernelGatewayApp.kernel_websocket_connection_class = (
    "kernelmode.gateway_ext.kg_extensions.NoDelayWebsocketConnection"
)
# A shared ZMQ context sized for hundreds of kernels (the default caps at ~170).
c.KernelGatewayApp.kernel_manager_class = (
    "kernelmode.gateway_ext.kg_extensions.ManyKernelsMappingKernelManager"
)
# Output is capped by the manager; the gateway must not silently drop IOPub messages.
c.ZMQChannelsWebsocketConnection.limit_rate = False

# ZMQ over ipc sockets in a per-kernel directory (set up by the provisioner).
c.KernelManager.transport = "ipc"
# Notice a dead kernel quickly (default 3 s) so a run reports kernel_died promptly.
c.KernelRestarter.time_to_dead = float(env.get("KERNELMODE_GW_POLL_INTERVAL", "0.5"))
c.KernelRestarter.stable_start_time = 5.0
# Restart a dead kernel on the same ipc socket paths: new "random ports" would leave open
# websockets talking to sockets that no longer exist.
c.KernelRestarter.random_ports_until_alive = False
c.MappingKernelManager.cull_idle_timeout = 0  # the manager reaps sessions itself
c.KernelManager.shutdown_wait_time = 2.0

# The provisioners' settings.
for cls in ("BwrapProvisioner", "UnsandboxedProvisioner", "DockerProvisioner"):
    c[cls].runtime_dir = env["KERNELMODE_GW_RUNTIME_DIR"]
    c[cls].state_dir = env["KERNELMODE_GW_STATE_DIR"]
    c[cls].default_limits = env.get("KERNELMODE_GW_LIMITS", "{}")
c.BwrapProvisioner.bwrap_path = env.get("KERNELMODE_GW_BWRAP", "bwrap")
c.BwrapProvisioner.uid_base = int(env.get("KERNELMODE_GW_UID_BASE", "200000"))
c.BwrapProvisioner.uid_count = int(env.get("KERNELMODE_GW_UID_COUNT", "65536"))
c.BwrapProvisioner.cgroups_mode = env.get("KERNELMODE_GW_CGROUPS", "auto")
c.DockerProvisioner.image = env.get("KERNELMODE_GW_DOCKER_IMAGE", "kernelmode/kernel:latest")
c.DockerProvisioner.cpus = float(env.get("KERNELMODE_GW_DOCKER_CPUS", "1.0"))
c.DockerProvisioner.uid_base = int(env.get("KERNELMODE_GW_UID_BASE", "200000"))
c.DockerProvisioner.uid_count = int(env.get("KERNELMODE_GW_UID_COUNT", "65536"))
c.DockerProvisioner.server = env.get("KERNELMODE_GW_SERVER_ID", "")
