"""S3Store against a real S3 API (moto's server, a subprocess on loopback).

moto serves presigned URLs but checks neither their signature nor their expiry (any
``X-Amz-Signature`` is accepted, also after ``X-Amz-Expires``). So the tamper and expiry tests
judge links the way S3 does with botocore's SigV4 signer, an implementation independent of
minio's: :func:`s3_verdict` gives the status a real S3 would answer (403 for a signature that
does not match or a lapsed link), while the downloads themselves go to moto over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import httpx
import pytest
from botocore.auth import S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from kernelmode.artifacts.base import ArtifactStore
from kernelmode.artifacts.s3 import S3Store
from kernelmode.config import ArtifactSettings
from kernelmode.errors import StoreError

from .conftest import S3Server

pytestmark = pytest.mark.timeout(60)

SIGV4_DATE = "%Y%m%dT%H%M%SZ"


def s3_verdict(url: str, access_key: str, secret_key: str, now: float | None = None) -> int:
    """The status S3 answers a presigned GET with, as far as the URL decides it: 403 if the
    signature does not match (SignatureDoesNotMatch) or the link has expired (AccessDenied),
    else 200. The signature is recomputed with botocore's S3 SigV4 query signer."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    signature = query.pop("X-Amz-Signature", "")
    auth_params = {k: query.pop(k) for k in list(query) if k.startswith("X-Amz-")}
    signed_at = datetime.strptime(auth_params["X-Amz-Date"], SIGV4_DATE).replace(
        tzinfo=timezone.utc)
    expires = int(auth_params["X-Amz-Expires"])
    region = auth_params["X-Amz-Credential"].split("/")[2]
    request = AWSRequest(
        method="GET",
        url=urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query, quote_via=quote),
                        "")),
    )
    signer = S3SigV4QueryAuth(Credentials(access_key, secret_key), "s3", region, expires=expires)
    with mock.patch("botocore.auth.get_current_datetime",
                    return_value=signed_at.replace(tzinfo=None)):
        signer.add_auth(request)
    expected = dict(parse_qsl(urlsplit(request.url).query))
    if any(expected[k] != v for k, v in auth_params.items()) or expected[
            "X-Amz-Signature"] != signature:
        return 403
    if (time.time() if now is None else now) > signed_at.timestamp() + expires:
        return 403
    return 200


def tamper(url: str) -> str:
    """The URL with one character of its X-Amz-Signature changed."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    out = []
    for k, v in query:
        if k == "X-Amz-Signature":
            v = v[:10] + ("0" if v[10] != "0" else "1") + v[11:]
        out.append((k, v))
    return urlunsplit(parts._replace(query=urlencode(out, quote_via=quote)))


async def download(url: str) -> httpx.Response:
    """GET without any credentials, straight to the URL (never through a proxy)."""
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        return await client.get(url)


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture()
async def store(s3_settings: ArtifactSettings) -> AsyncIterator[S3Store]:
    s = S3Store(s3_settings)
    await s.start()
    yield s
    await s.stop()


def test_is_an_artifact_store(s3_settings: ArtifactSettings) -> None:
    store: ArtifactStore = S3Store(s3_settings)
    assert store.name == "s3"


async def test_start_creates_missing_bucket(s3_settings: ArtifactSettings) -> None:
    s = S3Store(s3_settings)
    with pytest.raises(StoreError, match="no such bucket"):
        await s.list("")
    await s.start()
    assert await s.list("") == []
    await s.start()  # the bucket exists now: nothing to do, no error
    await s.stop()


async def test_start_with_region(s3_settings: ArtifactSettings, tmp_path: Path) -> None:
    settings = s3_settings.model_copy(update={"region": "eu-west-1"})
    s = S3Store(settings)
    await s.start()
    await s.put_file("r.txt", write(tmp_path / "r.txt", b"region"), "text/plain")
    url = await s.link("r.txt", "http://unused")
    assert "%2Feu-west-1%2Fs3%2F" in url
    assert (await download(url)).content == b"region"
    await s.stop()


async def test_round_trip_with_content_types(store: S3Store, tmp_path: Path) -> None:
    files = {
        "run1/out.csv": (b"a,b\n1,2\n", "text/csv"),
        "run1/plots/fig.png": (os.urandom(4096), "image/png"),
        "run1/data.bin": (bytes(range(256)) * 10, "application/octet-stream"),
        "run2/empty.txt": (b"", "text/plain"),
        "run2/sp ace/é.json": (b'{"k": 1}', "application/json"),
    }
    for key, (data, mime) in files.items():
        await store.put_file(key, write(tmp_path / key, data), mime)

    for key, (data, mime) in files.items():
        assert await store.get(key) == data
        response = await download(await store.link(key, "http://unused"))
        assert response.status_code == 200
        assert response.content == data
        assert response.headers["content-type"] == mime
        assert "content-disposition" not in response.headers

    assert sorted(await store.list("run1/")) == sorted(
        (k, len(d)) for k, (d, _) in files.items() if k.startswith("run1/"))
    assert sorted(await store.list("")) == sorted((k, len(d)) for k, (d, _) in files.items())
    assert await store.list("run1/plots/") == [("run1/plots/fig.png", 4096)]
    assert await store.list("nothing/") == []

    # Overwriting replaces the object whole.
    await store.put_file("run1/out.csv", write(tmp_path / "new.csv", b"x\n"), "text/csv")
    assert await store.get("run1/out.csv") == b"x\n"


async def test_large_file_goes_up_in_parts(store: S3Store, tmp_path: Path) -> None:
    data = os.urandom(6 * 1024 * 1024 + 123)  # > 5 MiB: minio uses a multipart upload
    await store.put_file("big/blob.bin", write(tmp_path / "blob.bin", data),
                         "application/octet-stream")
    assert await store.list("big/") == [("big/blob.bin", len(data))]
    assert await store.get("big/blob.bin") == data


async def test_link_is_absolute_presigned_and_downloads_exact_bytes(
        store: S3Store, s3_settings: ArtifactSettings, s3_server: S3Server,
        tmp_path: Path) -> None:
    data = os.urandom(100_000)
    await store.put_file("run/pic.png", write(tmp_path / "pic.png", data), "image/png")
    url = await store.link("run/pic.png", "http://manager.example:8888")

    parts = urlsplit(url)
    assert f"{parts.scheme}://{parts.netloc}" == s3_server.url  # S3's own URL, not base_url's
    assert parts.path == f"/{s3_settings.bucket}/run/pic.png"
    query = dict(parse_qsl(parts.query))
    assert query["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256"
    assert query["X-Amz-Expires"] == str(s3_settings.link_ttl_seconds)
    assert s3_verdict(url, s3_server.access_key, s3_server.secret_key) == 200

    response = await download(url)
    assert response.status_code == 200
    assert response.content == data
    assert response.headers["content-type"] == "image/png"


async def test_tampered_link_is_refused(store: S3Store, s3_server: S3Server,
                                        tmp_path: Path) -> None:
    await store.put_file("t/a.txt", write(tmp_path / "a.txt", b"secret"), "text/plain")
    url = await store.link("t/a.txt", "http://unused")
    keys = (s3_server.access_key, s3_server.secret_key)
    assert s3_verdict(url, *keys) == 200

    bad = tamper(url)
    assert bad != url and len(bad) == len(url)
    assert s3_verdict(bad, *keys) == 403
    # The signature covers the key, the expiry and the response headers too.
    assert s3_verdict(url.replace("/t/a.txt?", "/t/b.txt?"), *keys) == 403
    assert s3_verdict(url.replace("X-Amz-Expires=604800", "X-Amz-Expires=604799"), *keys) == 403
    assert s3_verdict(url, keys[0], "another-secret") == 403


async def test_expired_link_is_refused(s3_settings: ArtifactSettings, s3_server: S3Server,
                                       tmp_path: Path) -> None:
    s = S3Store(s3_settings, link_ttl_seconds=1)
    await s.start()
    await s.put_file("e/a.txt", write(tmp_path / "a.txt", b"soon gone"), "text/plain")
    url = await s.link("e/a.txt", "http://unused")
    await s.stop()
    query = dict(parse_qsl(urlsplit(url).query))
    assert query["X-Amz-Expires"] == "1"
    signed_at = datetime.strptime(query["X-Amz-Date"], SIGV4_DATE).replace(
        tzinfo=timezone.utc).timestamp()
    keys = (s3_server.access_key, s3_server.secret_key)

    assert s3_verdict(url, *keys, now=signed_at) == 200
    assert (await download(url)).content == b"soon gone"
    await asyncio.sleep(max(0.0, signed_at + 1.05 - time.time()))  # at most ~1 s
    assert s3_verdict(url, *keys) == 403


@pytest.mark.parametrize("ttl", [0, -5, 7 * 24 * 3600 + 1])
def test_link_ttl_override_is_bounded(s3_settings: ArtifactSettings, ttl: int) -> None:
    with pytest.raises(ValueError, match="link_ttl_seconds"):
        S3Store(s3_settings, link_ttl_seconds=ttl)


@pytest.mark.parametrize(("key", "mime", "filename"), [
    ("run/page.html", "text/html", 'filename="page.html"'),
    ("run/page2.html", "text/html; charset=utf-8", 'filename="page2.html"'),
    ("run/pic.svg", "image/svg+xml", 'filename="pic.svg"'),
    ("run/rapport é.html", "text/html", "filename*=UTF-8''rapport%20%C3%A9.html"),
])
async def test_html_and_svg_links_are_attachments(
        store: S3Store, s3_server: S3Server, tmp_path: Path, key: str, mime: str,
        filename: str) -> None:
    body = b"<svg xmlns='http://www.w3.org/2000/svg'><script>alert(1)</script></svg>"
    await store.put_file(key, write(tmp_path / "f", body), mime)
    url = await store.link(key, "http://unused")
    assert s3_verdict(url, s3_server.access_key, s3_server.secret_key) == 200
    response = await download(url)
    assert response.status_code == 200
    assert response.content == body
    assert response.headers["content-type"] == mime
    disposition = response.headers["content-disposition"]
    assert disposition.startswith("attachment;")
    assert filename in disposition
    assert disposition.isascii()


async def test_missing_key_is_a_store_error(store: S3Store) -> None:
    with pytest.raises(StoreError, match="no such object") as exc:
        await store.get("no/such/key")
    assert "no/such/key" in str(exc.value)
    with pytest.raises(StoreError, match="no such object"):
        await store.link("no/such/key", "http://unused")


async def test_missing_local_file_is_a_store_error(store: S3Store, tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        await store.put_file("k", tmp_path / "absent", "text/plain")
    assert await store.list("") == []


async def test_wrong_credentials_fail_start(s3_auth_server: S3Server) -> None:
    settings = ArtifactSettings(store="s3", endpoint=s3_auth_server.endpoint,
                                access_key="AKIANOSUCHKEY0000000", secret_key="wrong",
                                bucket="km-test-creds", secure=False)
    s = S3Store(settings)
    with pytest.raises(StoreError, match="InvalidAccessKeyId") as exc:
        await s.start()
    assert s3_auth_server.endpoint in str(exc.value)
    assert "wrong" not in str(exc.value)  # the secret never shows
    await s.stop()


def _operations(tmp: Path) -> dict[str, Callable[[S3Store], Awaitable[object]]]:
    f = write(tmp / "f.txt", b"x")
    return {
        "start": lambda s: s.start(),
        "put_file": lambda s: s.put_file("k.txt", f, "text/plain"),
        "get": lambda s: s.get("k.txt"),
        "list": lambda s: s.list(""),
        "link": lambda s: s.link("k.txt", "http://unused"),
    }


@pytest.mark.parametrize("op", ["start", "put_file", "get", "list", "link"])
async def test_dead_endpoint_fails(dead_settings: ArtifactSettings, tmp_path: Path, op: str) -> None:
    """Nobody listens: the error names the endpoint and the bucket."""
    s = S3Store(dead_settings)
    with pytest.raises(StoreError, match="unreachable") as exc:
        await asyncio.wait_for(_operations(tmp_path)[op](s), 10)
    assert dead_settings.endpoint is not None and dead_settings.endpoint in str(exc.value)
    assert dead_settings.bucket in str(exc.value)
    await s.stop()


@contextlib.contextmanager
def _listener(hold: bool) -> Iterator[tuple[str, list[int]]]:
    """A loopback listener and the count of connections it took: each is closed at once, or
    (``hold``) kept open and never answered."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    taken: list[int] = [0]
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:  # closed: the test is over
                return
            taken[0] += 1
            held.append(conn) if hold else conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}", taken
    finally:
        with contextlib.suppress(OSError):  # wakes the accept
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        thread.join(5)
        for conn in held:
            conn.close()


@pytest.fixture()
def slamming_endpoint() -> Iterator[tuple[str, list[int]]]:
    """Accepts each connection and closes it at once (minio's own retry policy makes 6
    connections to it, with back-off between)."""
    with _listener(hold=False) as endpoint:
        yield endpoint


@pytest.mark.parametrize("op", ["start", "put_file", "get", "list", "link"])
async def test_failing_endpoint_is_not_retried(dead_settings: ArtifactSettings,
                                               slamming_endpoint: tuple[str, list[int]], tmp_path: Path,
                                               op: str) -> None:
    """An endpoint that drops each connection fails the operation after one connection: no
    retries with back-off (minio's default policy would try 6 times)."""
    endpoint, taken = slamming_endpoint
    settings = dead_settings.model_copy(update={"endpoint": endpoint})
    s = S3Store(settings)
    with pytest.raises(StoreError, match="unreachable or failing") as exc:
        await asyncio.wait_for(_operations(tmp_path)[op](s), 10)
    assert taken[0] == 1, f"{taken[0]} connections for one {op}"
    assert endpoint in str(exc.value) and settings.bucket in str(exc.value)
    await s.stop()


@pytest.fixture()
def silent_endpoint() -> Iterator[tuple[str, list[int]]]:
    """Accepts each connection and never answers."""
    with _listener(hold=True) as endpoint:
        yield endpoint


@pytest.mark.parametrize("op", ["start", "get"])
async def test_hung_endpoint_times_out(dead_settings: ArtifactSettings, silent_endpoint: tuple[str, list[int]],
                                       tmp_path: Path, op: str) -> None:
    """The configured read timeout ends the wait (its error says which), and a read that timed
    out is not tried again: one connection."""
    endpoint, taken = silent_endpoint
    settings = dead_settings.model_copy(update={"endpoint": endpoint})
    s = S3Store(settings, read_timeout=1.0)
    with pytest.raises(StoreError, match=r"unreachable or failing .*ReadTimeout.*read timeout=1\.0"):
        await asyncio.wait_for(_operations(tmp_path)[op](s), 10)
    assert taken[0] == 1, f"{taken[0]} connections for one {op}"
    await s.stop()
