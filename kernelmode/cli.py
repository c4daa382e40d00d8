"""`kernelmode serve | egress-proxy | mcp | console | sessions | setup | doctor | config check`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError as PydanticValidationError

from . import loops
from .config import Settings, load_settings
from .errors import ConfigError
from .logs import setup_logging

if TYPE_CHECKING:
    from .banner import TokenSource


def _token_source(args: argparse.Namespace) -> TokenSource:
    """Where serve's token comes from, for the start-up block (config.py applies the same order)."""
    import os

    if args.token is not None:
        return "--token"
    return "KERNELMODE_TOKEN" if os.environ.get("KERNELMODE_TOKEN") else "config"


def _serve(args: argparse.Namespace) -> int:
    from .server import serve

    setup_logging(args.log_level, args.log_format or "auto")
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(f"kernelmode: {e.message}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, args.log_format or settings.server.log_format)
    server = settings.server
    try:
        if args.host is not None:
            server.host = args.host
        if args.port is not None:
            server.port = args.port
        if args.token is not None:
            server.token = args.token
        if args.data_dir is not None:
            server.data_dir = Path(args.data_dir)
        if args.sandbox is not None:
            settings.sandbox.backend = args.sandbox
    except ValueError as e:  # pydantic's ValidationError (e.g. --token equal to a tenant's token)
        print(f"kernelmode: {_flag_problem(e)}", file=sys.stderr)
        return 2
    return loops.run(serve(settings, token_source=_token_source(args)), settings.server.event_loop)


def _egress_proxy(args: argparse.Namespace) -> int:
    from .egress.front_main import make_ca, run, write_ca_bundle

    setup_logging(args.log_level, args.log_format or "auto")
    try:
        settings = load_settings(args.config)
        if args.data_dir is not None:
            settings.server.data_dir = Path(args.data_dir)
        if args.listen is not None:
            settings.egress.listen = args.listen
        if args.ca_dir is not None:
            settings.egress.ca_dir = Path(args.ca_dir)
    except (ConfigError, ValueError) as e:
        print(f"kernelmode: {e.message if isinstance(e, ConfigError) else _flag_problem(e)}", file=sys.stderr)
        return 2
    if args.make_ca:
        return make_ca(settings)
    if args.write_ca_bundle is not None:
        return write_ca_bundle(settings, Path(args.write_ca_bundle))
    setup_logging(args.log_level, args.log_format or settings.server.log_format)
    return loops.run(run(settings), settings.server.event_loop)


def _mcp(args: argparse.Namespace) -> int:
    import os

    setup_logging(args.log_level, args.log_format or "auto")
    url = args.url or os.environ.get("KERNELMODE_URL")
    if url:
        token = args.token or os.environ.get("KERNELMODE_TOKEN")
        if not token:
            print("kernelmode mcp: --url needs the server's token (--token or $KERNELMODE_TOKEN)",
                  file=sys.stderr)
            return 2
        from .mcp.stdio import bridge

        return asyncio.run(bridge(url, token))
    # The embedded start allocates ~200k long-lived objects (modules, classes, pydantic schemas):
    # the collector ran over them again and again (~0.1 s of CPU before the first result).
    # Resumed once the service has started (embedded.py), or here if it never does.
    gc.disable()
    try:
        return _embedded(args)
    finally:
        gc.enable()


def _embedded(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(f"kernelmode: {e.message}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, args.log_format or settings.server.log_format)
    # Embedded: its own loopback port for download links unless one is asked for.
    settings.server.port = args.port if args.port is not None else 0
    if args.data_dir is not None:
        settings.server.data_dir = Path(args.data_dir)
    if args.sandbox is not None:
        settings.sandbox.backend = args.sandbox
    if args.token is not None:
        settings.server.token = args.token
    from .embedded import embedded  # not the MCP SDK yet: the gateway's start goes first

    return loops.run(embedded(settings), settings.server.event_loop)


def _console(args: argparse.Namespace) -> int:
    from .console.app import list_sessions, run_console

    if args.list or not args.session_id:
        return list_sessions(args.url, args.token)
    return run_console(args.url, args.token, args.session_id, args.console_args,
                       connection_file_only=args.connection_file, transport=args.transport)


def _sessions(args: argparse.Namespace) -> int:
    from .console.app import list_sessions

    return list_sessions(args.url, args.token)


def _config_check(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.file)
    except ConfigError as e:
        print(f"kernelmode: {e.message}", file=sys.stderr)
        return 2
    data = settings.model_dump(mode="json", exclude={"server": {"token"}})
    # Secrets interpolated from the environment stay out of the printout.
    if data["artifacts"].get("secret_key"):
        data["artifacts"]["secret_key"] = "***"
    for tenant in data["server"]["tenants"]:
        tenant["token"] = "***"
    for secret in data["egress"]["secrets"]:
        secret["value"] = "***"
    for server in data["mcp_servers"]:
        for part in ("env", "headers"):
            server[part] = {k: "***" for k in server.get(part, {})}
    print(json.dumps(data, indent=2))
    return 0


def _with_flags(args: argparse.Namespace) -> Settings:
    """Settings of --config and the environment, with serve's flags applied (raise ConfigError)."""
    settings = load_settings(args.config)
    try:
        for flag, (section, key) in {"host": ("server", "host"), "port": ("server", "port"),
                                     "data_dir": ("server", "data_dir"),
                                     "sandbox": ("sandbox", "backend")}.items():
            if getattr(args, flag, None) is not None:
                setattr(getattr(settings, section), key, getattr(args, flag))
    except PydanticValidationError as e:
        raise ConfigError(_flag_problem(e)) from e
    return settings


def _flag_problem(e: ValueError) -> str:
    """A flag out of range, in one line as for the file (`--port: Input should be ...`)."""
    if not isinstance(e, PydanticValidationError):
        return str(e)
    return "; ".join((f"--{str(err['loc'][-1]).replace('_', '-')}: " if err["loc"] else "") + err["msg"]
                     for err in e.errors())


def _setup(args: argparse.Namespace) -> int:
    from .errors import SetupFailed
    from .setup_env import REQUIREMENTS, build_kernel_env

    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(f"kernelmode: {e.message}", file=sys.stderr)
        return 2
    configured = settings.sandbox.kernel_python.parent.parent
    target = Path(args.kernel_env).absolute() if args.kernel_env else configured
    try:
        python = build_kernel_env(target, args.python, Path(args.requirements) if args.requirements
                                  else REQUIREMENTS, force=args.force, quiet=args.quiet,
                                  extra=settings.kernel.extra_requirements)
    except SetupFailed as e:
        print(f"kernelmode setup: {e.message}", file=sys.stderr)
        return 1
    if target != configured:
        print(f"serve looks for {configured / 'bin' / 'python'}: set sandbox.kernel_python to "
              f"{python} (or KERNELMODE_SANDBOX__KERNEL_PYTHON={python})")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import diagnose

    try:
        settings = _with_flags(args)
    except ConfigError as e:
        if args.json:
            print(json.dumps({"ok": False, "backend": None, "checks": [
                {"name": "config", "status": "fail", "detail": e.message, "fix": "fix the setting named"}]}))
        else:
            print(f"kernelmode: {e.message}", file=sys.stderr)
        return 1
    report = diagnose(settings)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernelmode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the REST API with its Kernel Gateway and sandboxed kernels")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8888; 0 picks a free one)")
    serve.add_argument("--token", help="API bearer token (default $KERNELMODE_TOKEN, else generated)")
    serve.add_argument("--data-dir", help="sessions, workspaces and runtime files (default ./.kernelmode)")
    serve.add_argument("--config", help="kernelmode.yaml")
    serve.add_argument("--sandbox", choices=["auto", "docker", "bwrap", "none"],
                       help="kernel sandbox (default auto: docker when an engine and the kernel image "
                       "are there, else bwrap; 'none' = NO isolation, development only)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", choices=["text", "json"], help="stderr log lines (default "
                       "server.log_format: text on a terminal, JSON lines with ts and level otherwise)")
    serve.set_defaults(func=_serve)
    egress = sub.add_parser("egress-proxy", help="the egress proxy for kernels on other hosts (Enterprise "
                            "Gateway nodes, Kubernetes pods), on TCP at egress.listen")
    egress.add_argument("--config", help="kernelmode.yaml (the managers' own: same egress and store)")
    egress.add_argument("--listen", help="host:port (default egress.listen)")
    egress.add_argument("--data-dir", help="as for serve (the SQLite store and the egress CA live there)")
    egress.add_argument("--ca-dir", help="the deployment CA's directory (default egress.ca_dir, else DATA_DIR/egress)")
    egress.add_argument("--make-ca", action="store_true", help="make the deployment CA (ca.pem, ca-key.pem) "
                        "in the CA directory and exit (refused if one is there)")
    egress.add_argument("--write-ca-bundle", metavar="PATH", help="write what remote kernels trust (system CAs, "
                        "egress.upstream_ca_file, the deployment CA) to PATH and exit: the file behind "
                        "egress.remote_ca_bundle")
    egress.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    egress.add_argument("--log-format", choices=["text", "json"], help="as for serve")
    egress.set_defaults(func=_egress_proxy)
    mcp = sub.add_parser("mcp", help="serve the MCP tools over stdio (for MCP clients that launch commands)")
    mcp.add_argument("--url", help="use a running server (else $KERNELMODE_URL; neither: start an embedded one)")
    mcp.add_argument("--token", help="that server's token (default $KERNELMODE_TOKEN)")
    mcp.add_argument("--config", help="kernelmode.yaml (embedded mode)")
    mcp.add_argument("--data-dir", help="embedded mode: data dir (default: a fresh one, removed at exit)")
    mcp.add_argument("--port", type=int, help="embedded mode: port for download links (default: any free one)")
    mcp.add_argument("--sandbox", choices=["auto", "docker", "bwrap", "none"], help="embedded mode: kernel sandbox")
    mcp.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    mcp.add_argument("--log-format", choices=["text", "json"], help="stderr log lines (as for serve)")
    mcp.set_defaults(func=_mcp)
    console = sub.add_parser(
        "console", epilog="Arguments after -- go to jupyter console.", help="attach jupyter console to a live session's kernel (through kernelmode and its token)")
    console.add_argument("session_id", nargs="?", help="the session (omit, or --list, to list them)")
    console.add_argument("--list", action="store_true", help="list the sessions and exit")
    console.add_argument("--url", help="the server (default $KERNELMODE_URL, else http://127.0.0.1:8888)")
    console.add_argument("--token", help="its token (default $KERNELMODE_TOKEN)")
    console.add_argument("--connection-file", action="store_true",
                         help="do not start a console: print a connection file for another frontend "
                         "(jupyter qtconsole --existing FILE) and relay until Ctrl-C")
    console.add_argument("--transport", choices=["ipc", "tcp"], default="ipc",
                         help="local sockets for the frontend: ipc in a private dir (default) or loopback tcp")
    console.set_defaults(func=_console)
    sessions = sub.add_parser("sessions", help="a table of the server's sessions")
    sessions.add_argument("--url", help="the server (default $KERNELMODE_URL, else http://127.0.0.1:8888)")
    sessions.add_argument("--token", help="its token (default $KERNELMODE_TOKEN)")
    sessions.set_defaults(func=_sessions)
    setup = sub.add_parser("setup", help="build the kernel environment (a venv with ipykernel and the "
                           "libraries kernels can import) where serve looks for it")
    setup.add_argument("--kernel-env", help="where to build it (default: the venv of sandbox.kernel_python)")
    setup.add_argument("--python", help="the Python to build it from (default /usr/bin/python3: "
                       "sandboxed kernels run as other users and must be able to read it)")
    setup.add_argument("--requirements", help="a requirements file (default: the one shipped with "
                       "kernelmode, the same list the Docker kernel image installs)")
    setup.add_argument("--config", help="kernelmode.yaml (for sandbox.kernel_python and "
                       "kernel.extra_requirements)")
    setup.add_argument("--force", action="store_true", help="rebuild even when it is up to date")
    setup.add_argument("--quiet", action="store_true", help="no pip progress")
    setup.set_defaults(func=_setup)
    doctor = sub.add_parser("doctor", help="check everything serve needs and say what to do about "
                            "each missing piece (exit 0: serve can run)")
    doctor.add_argument("--config", help="kernelmode.yaml")
    doctor.add_argument("--host", help="as for serve")
    doctor.add_argument("--port", type=int, help="as for serve")
    doctor.add_argument("--data-dir", help="as for serve")
    doctor.add_argument("--sandbox", choices=["auto", "docker", "bwrap", "none"], help="as for serve")
    doctor.add_argument("--json", action="store_true", help="the report as JSON")
    doctor.set_defaults(func=_doctor)
    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a kernelmode.yaml and print the result")
    check.add_argument("file")
    check.set_defaults(func=_config_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `kernelmode console SID [options] -- [jupyter console options]`
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(argv)
    args.console_args = passthrough
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
