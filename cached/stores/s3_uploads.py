"""S3 uploads: a local file as one PUT, or as a multipart upload with bounded parts in
flight, conditional where asked (``If-None-Match: *``): the cold tier's promotion of a
verified shard to the warm tier.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from contextlib import suppress
from pathlib import Path
from typing import Any

from botocore import exceptions as boto_exc

from ..errors import VerifyError
from .s3_client import _CHANGED_CODES, S3Client, _request, _s3_location, _status_and_code

log = logging.getLogger(__name__)

# S3's multipart limits: every part but the last at least 5 MiB, at most 10,000 parts.
_MIN_UPLOAD_PART = 5 << 20
_MAX_UPLOAD_PARTS = 10_000
_MAX_PUT = 5 << 30  # the largest single PUT S3 accepts


def _exists_already(exc: BaseException) -> bool:
    """Whether a conditional write (``If-None-Match: *``) failed because the key exists.

    412: it exists. 409 ConditionalRequestConflict: another writer is completing the
    same key right now; either way someone else's copy wins and ours is not needed.
    """
    if not isinstance(exc, boto_exc.ClientError):
        return False
    status, code, _ = _status_and_code(exc)
    return status == 412 or code in _CHANGED_CODES or code == "ConditionalRequestConflict"


def _read_exactly(fd: int, length: int, offset: int, path: Path) -> bytes:
    """``length`` bytes of ``fd`` at ``offset``; VerifyError if the file is shorter."""
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise VerifyError(
            f"{path}: expected {length} bytes at offset {offset}, read {len(data)}; "
            "the file shrank while being uploaded"
        )
    return data


class S3Uploads(S3Client):
    """The uploads of :class:`~cached.stores.s3.S3Source`."""

    def upload_part_size(self, size: int) -> int:
        """The part size :meth:`put` uses for a ``size``-byte multipart upload.

        ``[s3] part_size``, raised to S3's 5 MiB minimum (every part but the last) and
        to whatever keeps the upload within 10,000 parts.
        """
        return max(self._cfg.part_size_bytes, _MIN_UPLOAD_PART, math.ceil(size / _MAX_UPLOAD_PARTS))

    async def put(self, url: str, path: Path, size: int, *, if_absent: bool = False) -> None:
        """Upload the local file ``path``, which must hold ``size`` bytes, to ``url``.

        A file of at most ``[s3] part_size`` goes up as one PUT; a larger one as a
        multipart upload of :meth:`upload_part_size` parts, at most ``part_concurrency``
        in flight (memory stays within that many parts). The file is read in worker
        threads; every request runs under the retry budget, and a failed or cancelled
        multipart upload is aborted so that its parts are not left behind (and billed).

        ``if_absent`` makes the write conditional (``If-None-Match: *``): if the key
        exists by the time the upload completes, it is left as it is and ``put`` returns
        without error. That also makes a retried write safe when the first attempt did
        land but its answer was lost.

        Raises :class:`VerifyError` if the file is not ``size`` bytes, :class:`FetchError`
        (or its subclasses, as for reads) when the store refuses or keeps failing.
        """
        client = self._require_client()
        loc = _s3_location(url)
        fd = await asyncio.to_thread(os.open, path, os.O_RDONLY)
        try:
            actual = (await asyncio.to_thread(os.fstat, fd)).st_size
            if actual != size:
                raise VerifyError(
                    f"{path}: expected {size} bytes to upload to {url}, the file has "
                    f"{actual}; it changed since it was written"
                )
            condition = {"IfNoneMatch": "*"} if if_absent else {}
            if size <= min(self._cfg.part_size_bytes, _MAX_PUT):
                data = await asyncio.to_thread(_read_exactly, fd, size, 0, path)

                async def put_once() -> bool:
                    try:
                        await _request(
                            client.put_object,
                            Bucket=loc.bucket,
                            Key=loc.key,
                            Body=data,
                            **condition,
                        )
                    except Exception as exc:
                        if if_absent and _exists_already(exc):
                            return False
                        raise
                    return True

                written = await self._call(f"PUT {url}", url, put_once)
            else:
                written = await self._put_multipart(url, fd, path, size, condition=condition)
        finally:
            os.close(fd)
        if not written:
            log.info("%s already exists; not overwritten", url)

    async def _put_multipart(
        self, url: str, fd: int, path: Path, size: int, *, condition: dict[str, str]
    ) -> bool:
        """The multipart half of :meth:`put`; False if the key exists (``condition``)."""
        client = self._require_client()
        loc = _s3_location(url)
        key = {"Bucket": loc.bucket, "Key": loc.key}
        created = await self._call(
            f"POST {url}?uploads",
            url,
            lambda: _request(client.create_multipart_upload, **key),
        )
        upload_id = str(created["UploadId"])
        step = self.upload_part_size(size)
        slots = asyncio.Semaphore(self._cfg.part_concurrency)

        async def upload(number: int, offset: int) -> dict[str, Any]:
            async with slots:  # the read is inside, so memory holds only the parts in flight
                data = await asyncio.to_thread(
                    _read_exactly, fd, min(step, size - offset), offset, path
                )
                response = await self._call(
                    f"PUT {url} part {number}",
                    url,
                    lambda: _request(
                        client.upload_part,
                        **key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=data,
                    ),
                )
            return {"PartNumber": number, "ETag": response["ETag"]}

        async def complete(parts: list[dict[str, Any]]) -> bool:
            if condition and await self._exists(client, key):
                return False
            try:
                await _request(
                    client.complete_multipart_upload,
                    **key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    **condition,
                )
            except Exception as exc:
                if condition and _exists_already(exc):
                    return False
                raise
            return True

        completed = False
        try:
            tasks = [
                asyncio.create_task(upload(n, offset))
                for n, offset in enumerate(range(0, size, step), start=1)
            ]
            try:
                parts = await asyncio.gather(*tasks)
            finally:
                # On any failure stop the parts still running before aborting the upload.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            completed = await self._call(f"POST {url}?uploadId", url, lambda: complete(list(parts)))
            return completed
        finally:
            if not completed:
                # Also when the key already existed: a refused completion leaves the
                # upload open. Shielded, so that a cancelled put still cleans up.
                await asyncio.shield(self._abort(client, url, key, upload_id))

    async def _exists(self, client: Any, key: dict[str, str]) -> bool:
        """Whether the key exists now: the check before a conditional completion.

        Ceph RGW 16.2 ignores ``If-None-Match`` on CompleteMultipartUpload (it honours it
        on PUT) and would overwrite an object that appeared meanwhile. The HEAD narrows
        that race to one round trip; where the header works, the store still decides.
        Errors other than 404 propagate, to the retry budget of the completion.
        """
        try:
            await _request(client.head_object, **key)
        except boto_exc.ClientError as exc:
            if _status_and_code(exc)[0] == 404:
                return False
            raise
        return True

    async def _abort(self, client: Any, url: str, key: dict[str, str], upload_id: str) -> None:
        """Best effort: one attempt; a bucket lifecycle rule catches what this misses."""
        with suppress(Exception):
            await _request(client.abort_multipart_upload, **key, UploadId=upload_id)
            return
        log.warning(
            "%s: could not abort multipart upload %s; its parts remain until a lifecycle "
            "rule (AbortIncompleteMultipartUpload) removes them",
            url,
            upload_id,
        )
