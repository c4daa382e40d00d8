"""An external gateway: one that kernelmode did not start (``gateway.url``).

`serve` checks it answers (``GET /api`` with ``gateway.auth_token``) before anything else starts,
and fails fast with an error naming the key to fix. The manager never stops such a gateway: its
kernels outlive the manager, and the next `serve` adopts the sessions they belong to.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from ..errors import ConfigError, GatewayForbidden
from .client import GatewayClient

if TYPE_CHECKING:
    from ..config import Settings

log = logging.getLogger("kernelmode.gateway")


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"token {token}"} if token else {}


async def check_external(url: str, token: str | None, validate_cert: bool, timeout: float = 10.0) -> str:
    """The gateway's version, or ConfigError naming ``gateway.url`` (unreachable, not a
    Jupyter gateway) or ``gateway.auth_token`` (refused with 401/403)."""
    req = HTTPRequest(f"{url.rstrip('/')}/api", headers=_headers(token), request_timeout=timeout,
                      connect_timeout=timeout, validate_cert=validate_cert)
    try:
        resp = await AsyncHTTPClient().fetch(req)
    except HTTPClientError as e:
        if e.code in (401, 403):
            raise ConfigError(f"the gateway at gateway.url={url} refused gateway.auth_token "
                              f"(HTTP {e.code}): set KERNELMODE_GATEWAY__AUTH_TOKEN to its token") from None
        raise ConfigError(f"the gateway at gateway.url={url} did not answer GET /api "
                          f"({e.code}: {e.message})") from None
    except OSError as e:
        raise ConfigError(f"the gateway at gateway.url={url} is unreachable: {e}") from None
    try:
        version = str(json.loads(resp.body)["version"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"gateway.url={url} answered GET /api, but not as a Jupyter gateway") from None
    return version


async def connect_external(s: Settings, max_message_bytes: int) -> tuple[GatewayClient, set[str]]:
    """A client for the external gateway of ``s.gateway`` (checked first), and the ids of the
    kernels running there (a previous manager's sessions among them are adopted)."""
    gw = s.gateway
    assert gw.url is not None
    version = await check_external(gw.url, gw.auth_token, gw.validate_cert)
    client = GatewayClient(gw.url, gw.auth_token or "", request_timeout=gw.launch_timeout_seconds + 10,
                           max_message_bytes=max_message_bytes, kernel_name=gw.kernel_name,
                           validate_cert=gw.validate_cert)
    try:
        kernels = {str(k["id"]) for k in await client.list_kernels()}
    except GatewayForbidden:
        # Enterprise Gateway's default: without the listing no session can be adopted and a
        # restarted gateway's lost kernels cannot be named, so refuse to start instead.
        raise ConfigError(f"the gateway at gateway.url={gw.url} refuses GET /api/kernels (403): "
                          "on Enterprise Gateway set c.EnterpriseGatewayApp.list_kernels = True "
                          "(EG_LIST_KERNELS=True)") from None
    log.info("using the external kernel gateway at %s (version %s, %d kernel(s) running there)",
             gw.url, version, len(kernels))
    return client, kernels
