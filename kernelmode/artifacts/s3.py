"""An artifact store on any S3-compatible service (AWS S3, MinIO, Ceph, ...), via the official
``minio`` client.

The minio client is blocking (urllib3 underneath): every call to it runs in a worker thread with
``asyncio.to_thread``, and every exception it or urllib3 raises becomes a ``StoreError`` in one
place, :meth:`S3Store._run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO, TypeVar
from urllib.parse import quote

import certifi
import urllib3
from minio import Minio
from minio.error import MinioException, S3Error
from minio.helpers import DictType
from urllib3.exceptions import HTTPError, MaxRetryError
from urllib3.util import Retry, Timeout

from kernelmode.artifacts.base import linkable
from kernelmode.config import ArtifactSettings

from ..errors import StoreError

T = TypeVar("T")

# Types a browser would render (and run scripts in) at the store's origin: links to these ask S3
# to answer with ``Content-Disposition: attachment`` so that they are downloaded instead.
ATTACHMENT_TYPES = frozenset({
    "text/html",
    "image/svg+xml",
    "application/xhtml+xml",
    "text/xml",
    "application/xml",
})

# SigV4 presigned URLs live between 1 second and 7 days.
_MIN_TTL, _MAX_TTL = 1, 7 * 24 * 3600


def content_disposition(key: str) -> str:
    """``attachment`` with the key's last path part as file name (ASCII fallback + RFC 5987)."""
    name = key.rsplit("/", 1)[-1] or "download"
    ascii_name = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(name, safe='')}"


class S3Store:
    """Objects in one bucket of an S3-compatible service; links are SigV4 presigned GET URLs."""

    name = "s3"

    def __init__(
        self,
        settings: ArtifactSettings,
        *,
        link_ttl_seconds: int | None = None,
        connect_timeout: float = 3.0,
        read_timeout: float = 10.0,
    ) -> None:
        """``link_ttl_seconds`` overrides ``settings.link_ttl_seconds`` (settings can't go below
        60 s; tests use 1 s). The timeouts bound each HTTP request so that a dead or hung
        endpoint fails within seconds instead of minio's default of 5 minutes x 6 tries."""
        if not (settings.endpoint and settings.access_key and settings.secret_key):
            raise ValueError("S3Store needs artifacts.endpoint, access_key and secret_key")
        ttl = settings.link_ttl_seconds if link_ttl_seconds is None else link_ttl_seconds
        if not _MIN_TTL <= ttl <= _MAX_TTL:
            raise ValueError(f"link_ttl_seconds must be within {_MIN_TTL}..{_MAX_TTL}, not {ttl}")
        self._ttl = timedelta(seconds=ttl)
        self._bucket = settings.bucket
        self._region = settings.region
        self._where = (f"{'https' if settings.secure else 'http'}://{settings.endpoint} "
                       f"bucket {settings.bucket!r}")
        self._http = urllib3.PoolManager(
            timeout=Timeout(connect=connect_timeout, read=read_timeout),
            maxsize=10,
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
            # One more try after a refused/reset connection or a 5xx; none after a read
            # timeout (the server is there but stuck: waiting again would only double the wait).
            retries=Retry(total=2, connect=1, read=0, status=1, backoff_factor=0.2,
                          status_forcelist=(500, 502, 503, 504)),
        )
        self._client = Minio(
            settings.endpoint,
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            secure=settings.secure,
            region=settings.region,
            http_client=self._http,
        )

    # -- the one place where minio/urllib3 errors become StoreError -----------------------------

    async def _run(self, what: str, fn: Callable[[], T]) -> T:
        """Run the blocking ``fn`` (minio calls, and reading their responses) in a thread."""
        try:
            return await asyncio.to_thread(fn)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                detail = "no such object"
            elif exc.code == "NoSuchBucket":
                detail = "no such bucket"
            elif exc.code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                detail = f"{exc.code}: check the access key, secret key and bucket permissions"
            else:
                detail = f"{exc.code}: {exc.message}"
            raise StoreError(f"S3 store at {self._where}: {what} failed: {detail}") from exc
        except MaxRetryError as exc:
            reason = exc.reason if exc.reason is not None else exc
            raise StoreError(f"S3 store at {self._where}: {what} failed: endpoint unreachable "
                             f"or failing ({type(reason).__name__}: {reason})") from exc
        except (MinioException, HTTPError, OSError, ValueError) as exc:
            raise StoreError(f"S3 store at {self._where}: {what} failed: "
                             f"{type(exc).__name__}: {exc}") from exc

    # -- ArtifactStore ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the bucket if missing. Fails (StoreError) if the endpoint is unreachable or the
        credentials are refused: both calls are signed requests that S3 checks."""

        def ensure_bucket() -> None:
            if self._client.bucket_exists(self._bucket):
                return
            try:
                self._client.make_bucket(self._bucket, location=self._region)
            except S3Error as exc:
                if exc.code != "BucketAlreadyOwnedByYou":  # another replica made it meanwhile
                    raise

        await self._run("start (check/create bucket)", ensure_bucket)

    async def stop(self) -> None:
        self._http.clear()

    async def put_file(self, key: str, path: Path, mime_type: str) -> None:
        # Atomic as the protocol demands: a single S3 PUT makes the object appear whole or not
        # at all. Files larger than one part (5 MiB+) go up as a multipart upload, which is
        # just as atomic: no object exists under the key until CompleteMultipartUpload succeeds,
        # and on failure minio aborts the upload (parts left by a crash mid-upload are invisible
        # and are cleaned by the bucket's AbortIncompleteMultipartUpload lifecycle rule, if set).
        await self._run(
            f"put {key!r}",
            lambda: self._client.fput_object(self._bucket, key, str(path), content_type=mime_type),
        )

    async def get(self, key: str) -> bytes:
        def fetch() -> bytes:
            response = self._client.get_object(self._bucket, key)
            try:
                return response.read()
            finally:
                response.close()
                response.release_conn()

        return await self._run(f"get {key!r}", fetch)

    @contextlib.contextmanager
    def reader(self, key: str) -> Iterator[BinaryIO]:
        try:
            response = self._client.get_object(self._bucket, key)
        except Exception as e:  # noqa: BLE001 - minio and urllib3 errors alike: the store failed
            raise StoreError(f"S3 store at {self._where}: get {key!r} failed: {e}") from e
        try:
            yield response  # type: ignore[misc]  # urllib3's response reads like a file
        finally:
            response.close()
            response.release_conn()

    async def delete(self, key: str) -> None:
        await self._run(f"delete {key!r}", lambda: self._client.remove_object(self._bucket, key))

    async def link(self, key: str, base_url: str) -> str:
        """A presigned GET URL, absolute, valid for the configured lifetime (``base_url`` is not
        used: the URL points at the S3 endpoint). Stats the object first, which also makes a
        link to a missing object a StoreError; HTML/SVG/XML links force a download."""

        def presign() -> str:
            info = self._client.stat_object(self._bucket, key)
            mime = (info.content_type or "").split(";", 1)[0].strip().lower()
            headers: DictType | None = ({"response-content-disposition": content_disposition(key)}
                       if mime in ATTACHMENT_TYPES else None)
            return self._client.presigned_get_object(self._bucket, key, expires=self._ttl,
                                                     response_headers=headers)

        if not linkable(key):
            raise StoreError(f"no download link for {key!r}")
        return await self._run(f"link {key!r}", presign)

    async def list(self, prefix: str) -> list[tuple[str, int]]:
        def listing() -> list[tuple[str, int]]:
            return [
                (obj.object_name, obj.size or 0)
                for obj in self._client.list_objects(self._bucket, prefix=prefix or None,
                                                     recursive=True)
                if obj.object_name is not None and not obj.is_dir
            ]

        return await self._run(f"list {prefix!r}", listing)
