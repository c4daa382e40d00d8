"""A remote kernel's egress credential: its kernel id and a random token, sent to the TCP front
(front.py) as ``Proxy-Authorization: Basic`` (HTTP_PROXY's ``user:password``). Only the token's
hash is ever stored (sessions/store/egress_tokens.py)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets


def new_token() -> str:
    """192 random bits as 48 hex digits: a valid KERNEL_* launch value (gateway/launch.py)."""
    return secrets.token_hex(24)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def credentials(headers: list[tuple[bytes, bytes]]) -> tuple[str, str] | None:
    """``(kernel id, token)`` from a ``Proxy-Authorization: Basic`` header, or None."""
    for name, value in headers:
        if name.lower() != b"proxy-authorization":
            continue
        scheme, _, encoded = value.strip().partition(b" ")
        if scheme.lower() != b"basic":
            return None
        try:
            user, sep, token = base64.b64decode(encoded.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return (user, token) if sep and user and token else None
    return None
