# An S3 server without MinIO's image: moto's server, from the Python package index.
# Used by deploy/compose/s3-moto.yml, which puts it in place of the `minio` service:
#   docker compose -f docker-compose.yml -f deploy/compose/s3-moto.yml up --build
# For when no image registry serving MinIO is reachable (an offline build host with a
# package mirror, or if quay.io stops serving MinIO too). moto keeps objects in memory:
# a restart of the service loses the dataset, and dataset-init rewrites it on the next
# `up`. A test stand-in, not a store for real data.
# Same base as ../../Dockerfile (keep the digests in step); BASE swaps it likewise.
ARG BASE=python:3.11-slim@sha256:1042b61448fef4ba92d16a8c7eb4996d027568ce64792a7877fd88511e0af7c6
FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The version of the project's own tests (pyproject.toml, extra `demo`).
RUN python3 -m venv /opt/moto \
 && /opt/moto/bin/pip install --no-cache-dir --disable-pip-version-check -q "moto[server,s3]==5.2.5"
USER 10001:10001
EXPOSE 9000
ENTRYPOINT ["/opt/moto/bin/moto_server", "-H", "0.0.0.0", "-p", "9000"]
