# The example training job of docker-compose.yml: cached_client + torch, and
# deploy/compose/trainer.py. Built from the repository root (the context):
#   docker build -f deploy/compose/trainer.Dockerfile -t cached-trainer:0.1.0 .
# A file of its own rather than a stage of ../../Dockerfile, so that the daemon's image
# never waits for torch (see the comment there). Same base, same pin, same BASE arg
# (keep the digests in step).
ARG BASE=python:3.11-slim@sha256:1042b61448fef4ba92d16a8c7eb4996d027568ce64792a7877fd88511e0af7c6

# ---- build: cached_client + torch in a virtual environment at /opt/trainer -----------
# A throwaway stage, like the daemon's: pip builds the client in the source tree.
FROM ${BASE} AS build
# Which torch. The default, plain `torch` from the package index pip is configured with,
# is on x86_64 Linux the CUDA build: several GB of wheels (the nvidia-* libraries), of
# no use on a laptop without an NVIDIA GPU; on arm64 (Apple silicon) it is the CPU
# build. For the CPU build on x86_64, set TORCH_INDEX_URL to PyTorch's CPU-only wheel
# index (its address is on pytorch.org's "Get Started" page: the one ending in /whl/cpu);
# pip then prefers torch from there (its version is 2.x.y+cpu, above PyPI's 2.x.y),
# about a tenth of the download. TORCH_SPEC may pin a version (torch==2.13.0) or be the
# URL of a wheel file.
ARG TORCH_SPEC=torch
ARG TORCH_INDEX_URL=
WORKDIR /src
COPY client/pyproject.toml client/setup.py client/MANIFEST.in client/
COPY client/csrc client/csrc
COPY client/cached_client client/cached_client
COPY client/cached_wire client/cached_wire
# torch first and alone, so that TORCH_INDEX_URL applies to it; then the client, whose
# other dependencies (pyzmq, numpy) come from the default index. The client's compiled
# local reader (client/setup.py, D32) is optional: the slim base has no C compiler, so
# this image's FastLoader reads in Python; a base with gcc builds it here.
RUN python3 -m venv /opt/trainer \
 && /opt/trainer/bin/pip install --no-cache-dir --disable-pip-version-check -q \
      ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC" \
 && /opt/trainer/bin/pip install --no-cache-dir --disable-pip-version-check -q ./client

# ---- the trainer's image ------------------------------------------------------------
FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/trainer/bin:$PATH
COPY --from=build /opt/trainer /opt/trainer
COPY deploy/compose/trainer.py /opt/trainer/trainer.py
# A training user of its own (uid 10002), in the daemon's group `cached` (gid 10001, the
# daemon image's): the daemon makes its ipc socket 0660 ([server] socket_mode) and its
# shard files 0640, so the group admits the trainer to both, as `usermod -aG cached` does
# on a systemd node. docker-compose.yml also passes the group with group_add, since a
# numeric USER uid:gid gets no supplementary groups from /etc/group.
# /run/cached is the mount point of the socket's volume; a new named volume takes the
# owner and mode of this directory, whichever of the two containers mounts it first.
RUN groupadd --gid 10001 cached \
 && useradd --uid 10002 --user-group --groups cached --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin trainer \
 && install -d -m 0750 -o 10001 -g 10001 /run/cached
USER 10002:10002
WORKDIR /opt/trainer
ENTRYPOINT ["python", "/opt/trainer/trainer.py"]
