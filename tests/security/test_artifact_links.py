"""Forged local-store download links: whatever the signature or expiry holds (non-ASCII text,
wrong length, absurd numbers), the answer is a JSON 403 that gives nothing away, never a 500."""

from __future__ import annotations

from urllib.parse import quote

import httpx

from tests.conftest import Server


def test_forged_links_are_403_never_500(server: Server) -> None:
    with server.client(token="") as anon:
        for expires, sig in [("9999999999", "é" * 64), ("9999999999", "\u2603"), ("9999999999", "0" * 64),
                             ("9" * 5000, "a" * 64), ("-1", ""), ("nan", "x"), ("", "")]:
            r = anon.get(f"/v1/artifacts/some/run/file.txt?expires={quote(expires)}&sig={quote(sig)}")
            assert r.status_code == 403, (expires, sig, r.status_code, r.text)
            assert r.json()["error"]["code"] == "forbidden"
        # Without the parameters, and on keys that try to leave the store.
        for path in ["/v1/artifacts/x", "/v1/artifacts/..%2F..%2Fsessions.sqlite3?expires=1&sig=a"]:
            r: httpx.Response = anon.get(path)
            assert r.status_code == 403, (path, r.status_code, r.text)
