"""WebDataset tars written in memory: the demo's dataset, the tests' and the benchmarks'
shards."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable, Mapping


def make_tar(samples: Iterable[tuple[str, Mapping[str, bytes]]]) -> bytes:
    """A WebDataset tar: for each ``(key, {ext: bytes})`` the members ``key.ext``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
