"""Helpers of deploy/check/systemd.sh (`make deploy-check`), one file for both sides:

``s3 DIR`` (on the host, with the project's venv): moto's S3 server on 127.0.0.1, a free
port, with a bucket of small WebDataset shards. Writes DIR/s3.json (endpoint, shard URLs)
and DIR/manifest.json (the SHA-256 of every sample member, for the reader), then keeps
DIR/requests.json up to date with the requests the server saw (GETs of shard keys), until
SIGTERM. The container shares the host's network, so the daemon inside reaches it.

``read MANIFEST`` (inside the container, as a training user, with /opt/cached/bin/python:
the daemon's venv, which has no torch): reads every shard of the manifest through the
daemon's socket with the torch-free ``cached_client.reader`` and compares each member's
bytes with the manifest. ``--local on|off|auto`` chooses local reads (the sample bytes
read from the hot tier's files; ``on`` fails where they cannot be opened), and the line
says which way the bytes came. Prints one line; exit 0 when all match, 1 on a mismatch, 2
when reading failed (the exception's type and message are printed, e.g. for a user who
may not connect to the socket).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

SHARDS = 4
SAMPLES_PER_SHARD = 32


def _member(shard: int, sample: int, ext: str) -> bytes:
    """Deterministic, incompressible-looking bytes of one member (a few KiB)."""
    seed = f"{shard}/{sample}/{ext}".encode()
    size = 1024 + 97 * sample
    out = bytearray()
    while len(out) < size:
        seed = hashlib.sha256(seed).digest()
        out += seed
    return bytes(out[:size])


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.rename(path)  # readers never see a half-written file


def serve_s3(out: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo))  # tests.s3server: moto with a request counter
    from cached_demo.tars import make_tar
    from tests.s3server import S3Server

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with S3Server.start() as s3:
        bucket = s3.new_bucket("deploy-check")
        manifest: dict[str, dict[str, dict[str, str]]] = {}
        for i in range(SHARDS):
            samples = [
                (f"s{i:02d}-{j:03d}", {ext: _member(i, j, ext) for ext in ("txt", "bin")})
                for j in range(SAMPLES_PER_SHARD)
            ]
            key = f"train/shard-{i:04d}.tar"
            s3.put(bucket, key, make_tar(samples))
            manifest[f"s3://{bucket}/{key}"] = {
                k: {ext: hashlib.sha256(data).hexdigest() for ext, data in m.items()}
                for k, m in samples
            }
        s3.reset_counts()  # count only what the daemon asks for
        _write_json(out / "manifest.json", manifest)
        _write_json(out / "s3.json", {"endpoint": s3.endpoint_url, "urls": list(manifest)})
        while not stop.is_set():
            shard_gets = s3.count("GET", rf"^/{bucket}/train/")
            _write_json(out / "requests.json", {"shard_gets": shard_gets})
            stop.wait(0.2)


_LOCAL = {"on": True, "off": False, "auto": None}


def read(manifest_path: Path, socket: str | None, local: str = "auto") -> int:
    from cached_client.reader import read_shard
    from cached_client.transport import Connection, resolve_endpoint

    manifest = json.loads(manifest_path.read_text())
    endpoint = resolve_endpoint(socket)
    conn = Connection(endpoint, connect_timeout_s=5.0, local_reads=_LOCAL[local])
    samples = bad = nbytes = 0
    try:
        for url, expected in manifest.items():
            for key, members in read_shard(conn, url, f"deploy-check-{os.getpid()}"):
                got = {ext: hashlib.sha256(frame.buffer).hexdigest() for ext, frame in members}
                nbytes += sum(len(frame.buffer) for _, frame in members)
                samples += 1
                bad += got != expected.get(key)
    except Exception as exc:  # reported, not raised: the caller checks who may read
        print(f"error: {type(exc).__name__}: {exc}")
        return 2
    finally:
        # Answered locally, and still asking after every shard: each was read from its file.
        local_all = conn.holds_local_leases and conn.asks_local
        way = "from the hot tier's files" if local_all else "through the socket"
        conn.close()
    want = sum(len(v) for v in manifest.values())
    if bad or samples != want:
        print(f"mismatch: {samples} samples read of {want}, {bad} with wrong bytes")
        return 1
    print(f"ok: {samples} samples of {len(manifest)} shards, {nbytes} bytes {way}, all match")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s3 = sub.add_parser("s3", help="run moto with the shards (host side)")
    s3.add_argument("dir", type=Path)
    rd = sub.add_parser("read", help="read the shards through the daemon (container side)")
    rd.add_argument("manifest", type=Path)
    rd.add_argument("--socket", help="ZeroMQ endpoint (default: the client's)")
    rd.add_argument("--local", choices=sorted(_LOCAL), default="auto", help="local reads")
    args = parser.parse_args()
    if args.command == "s3":
        serve_s3(args.dir)
        return 0
    return read(args.manifest, args.socket, args.local)


if __name__ == "__main__":
    sys.exit(main())
