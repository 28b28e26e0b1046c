# An S3 server without MinIO's image: Ceph's RADOS Gateway from Debian's packages (Ceph
# 16.2 on bookworm), a one-node cluster in one container. Used by deploy/compose/s3-rgw.yml,
# which puts it in place of the `minio` service:
#   docker compose -f docker-compose.yml -f deploy/compose/s3-rgw.yml up --build
# `make compose-check` (deploy/check/compose.sh) runs the stack that way, with BASE set to
# a Debian root made by debootstrap and imported as an image, since no image registry is
# reachable there. A real S3 engine (the one the S3-facing tests run on, tests/rgw.py),
# but a test stand-in for data: the OSD is a MemStore, so the objects live in memory and
# a restart of the service loses them (dataset-init writes them again on the next `up`).
# Any Debian bookworm image will do as BASE.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
# Ceph's monitor, OSD, gateway and its admin tool, and nothing they merely recommend. The
# versions are bookworm's (16.2.x); pinning them would break at each Debian point release.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ceph-mon ceph-osd radosgw ceph-common \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/*
# The cluster's start and stop: the very script the S3-facing tests start it with (its
# comments explain each setting and the stop order), standard library only. Built from the
# repository's root (.dockerignore lets this file in).
COPY tests/rgw.py /opt/rgw/rgw.py
# The S3 API, path-style addressing (http://minio:9000/BUCKET/KEY in the stack).
EXPOSE 9000
# Root in the container: the Ceph daemons run as root here (no ceph user set up, no
# systemd); nothing but the S3 port is reachable from outside the container.
# The S3 user's keys: $RGW_ACCESS_KEY / $RGW_SECRET_KEY (s3-rgw.yml passes MinIO's). Ready
# (the healthcheck's /run/rgw/ready) once the user exists; SIGTERM stops radosgw, then the
# OSD, then the monitor; a daemon that exits ends the container with status 1.
ENTRYPOINT ["python3", "/opt/rgw/rgw.py", "--host", "0.0.0.0", "--port", "9000", "--ready-file", "/run/rgw/ready"]
