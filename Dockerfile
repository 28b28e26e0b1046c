# The cached daemon as a container image (no torch: the daemon never imports it).
#   docker build -t cached .
#   docker run --rm -e CACHED_SERVER_HTTP=0.0.0.0:9464 -p 9464:9464 cached
# See docs/operations.md for docker-compose and Kubernetes.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src

# Why the install is split in steps: cached-daemon depends on cached-client (it shares
# its wire protocol module), and cached-client depends on torch, which the daemon
# never imports and which would add gigabytes to the image. pip's resolver follows the
# dependencies of an already-installed package too, so both packages go in with
# --no-deps and their real dependencies are installed explicitly:
#   1. the client without torch, then the client's other dependencies (pyzmq, numpy);
#   2. the daemon's dependencies, read from pyproject.toml (minus cached-client) so
#      this file cannot drift from it, then the daemon itself.
# pip then reports "cached-client requires torch, which is not installed": expected.
# Only the package sources are copied: the build context may hold a .venv.
COPY client/pyproject.toml client/
COPY client/cached_client client/cached_client
RUN pip install --no-deps ./client \
 && pip install "pyzmq>=26" "numpy>=1.24"

# README.md* : pyproject.toml names a readme; the glob keeps the build working while
# the file does not exist yet.
COPY pyproject.toml README.md* ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.startswith('cached-client')))" > /tmp/daemon-requirements.txt \
 && pip install -r /tmp/daemon-requirements.txt \
 && rm /tmp/daemon-requirements.txt
COPY cached cached
RUN pip install --no-deps . \
 && rm -rf /src/build /src/*.egg-info

# A fixed non-root uid, so hostPath/volume ownership can be prepared for it
# (Kubernetes: runAsUser/fsGroup 10001).
RUN groupadd --system --gid 10001 cached \
 && useradd --system --uid 10001 --gid cached --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin cached \
 && mkdir -p /var/cache/cached /run/cached \
 && chown cached:cached /var/cache/cached /run/cached

# The hot tier ([cache] dir) and the ipc socket's directory ([server] socket default
# ipc:///run/cached/cached.sock); mount volumes or host paths here.
VOLUME ["/var/cache/cached"]

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /var/cache/cached

# The HTTP admin endpoint (/metrics, /healthz, /readyz, /status). The daemon binds
# 127.0.0.1:9464 by default, unreachable from outside the container: set
# CACHED_SERVER_HTTP=0.0.0.0:9464 (or [server] http in the config file). It is not set
# here because an environment variable overrides the config file, and a value baked
# into the image would silently win over a mounted config.
EXPOSE 9464

ENTRYPOINT ["cached"]
CMD ["serve"]
