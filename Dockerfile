# The cached daemon as a container image (no torch: the daemon never imports it).
#   docker build -t cached:0.1.0 .
#   docker run --rm -e CACHED_SERVER_HTTP=0.0.0.0:9464 -p 127.0.0.1:9464:9464 cached:0.1.0
# cached:0.1.0 is the one image name of all three deployment forms: this build,
# docker-compose.yml and deploy/k8s/daemonset.yaml.
#
# The example training job of docker-compose.yml (cached_client + torch) has its own
# file, deploy/compose/trainer.Dockerfile, not a stage here: a builder without BuildKit
# (Debian's docker.io, DOCKER_BUILDKIT=0) builds every stage of a file whatever the
# target, and a torch stage here cost the daemon's build a 5.9 GB torch download there.
# See docs/operations.md for docker-compose and Kubernetes.

# The base, pinned by digest so that a rebuild gets the same bytes; the digest is that
# of the multi-arch index (one pin for amd64 and arm64). A tag alone moves with every
# Debian or CPython patch release. To update (security fixes land in the base):
#   docker buildx imagetools inspect python:3.11-slim    # the "Digest:" line
# then replace the digest below, rebuild, and run the tests. Python 3.11 is the floor
# of pyproject.toml (requires-python).
# BASE can be swapped at build time (`--build-arg BASE=...`): a mirror of this same
# image, or a local image where no registry is reachable.
ARG BASE=python:3.11-slim@sha256:1042b61448fef4ba92d16a8c7eb4996d027568ce64792a7877fd88511e0af7c6

# ---- build: the daemon in a virtual environment at /opt/cached -----------------------
# A throwaway stage: pip builds the two packages in the source tree (build/,
# *.egg-info), and neither the sources nor those leftovers reach the final image, which
# copies /opt/cached alone. A venv rather than the base's site-packages, so that one
# COPY carries the whole install and nothing else of the build stage comes along.
FROM ${BASE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the install needs (.dockerignore keeps the rest out of the build context);
# the dependency lists come from the two pyproject.toml files, read by the script.
COPY client/pyproject.toml client/
COPY client/cached_client client/cached_client
COPY client/cached_wire client/cached_wire
COPY pyproject.toml README.md ./
COPY cached cached
COPY cached_demo cached_demo
COPY deploy/install-daemon.sh deploy/
# The shared installer (also used by the systemd install): the daemon without torch.
RUN python3 -m venv /opt/cached \
 && sh deploy/install-daemon.sh /opt/cached/bin/python /src

# ---- the daemon's image ---------------------------------------------------------------
FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/cached/bin:$PATH
COPY --from=build /opt/cached /opt/cached

# A fixed non-root uid and gid, so hostPath/volume ownership can be prepared for it
# (Kubernetes: runAsUser/runAsGroup 10001). The directories are the group's (0750): a
# training container with gid 10001 among its groups reaches the socket and reads the
# shards (docs/operations.md, "Security model"); a new volume takes these modes.
RUN groupadd --gid 10001 cached \
 && useradd --uid 10001 --gid cached --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin cached \
 && install -d -m 0750 -o cached -g cached /var/cache/cached /run/cached

# The hot tier ([cache] dir) and the ipc socket's directory ([server] socket default
# ipc:///run/cached/cached.sock); mount volumes or host paths here.
VOLUME ["/var/cache/cached"]

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
# Not the hot tier (the daemon owns that directory's contents) and not writable: the
# daemon writes nowhere relative to its working directory, and a stray relative write
# should fail loudly rather than land among the cached shards.
WORKDIR /opt/cached

# The HTTP admin endpoint (/metrics, /healthz, /readyz, /status). The daemon binds
# 127.0.0.1:9464 by default, unreachable from outside the container: set
# CACHED_SERVER_HTTP=0.0.0.0:9464 (or [server] http in the config file). It is not set
# here because an environment variable overrides the config file, and a value baked
# into the image would silently win over a mounted config.
EXPOSE 9464

ENTRYPOINT ["cached"]
CMD ["serve"]
