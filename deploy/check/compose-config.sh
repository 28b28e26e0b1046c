#!/usr/bin/env bash
# `docker-compose config` on docker-compose.yml, alone and with the test override
# deploy/compose/s3-moto.yml: the files parse, every key is known to Compose, the
# anchors, merges and ${VAR:-default}s resolve.
# Debian's docker-compose v1 (1.29) validates offline (no Docker engine needed). What
# users run is `docker compose` v2: the files use only keys that both know.
# Without docker-compose it says so in one line and exits 0 (a skip, not a pass).
set -euo pipefail
cd "$(dirname "$0")/../.."

compose=${DOCKER_COMPOSE:-docker-compose}
if ! command -v "$compose" >/dev/null; then
    echo "compose-config: $compose not found, skipped (make system-deps installs it)"
    exit 0
fi

# The user's environment must not decide the outcome: the files' own defaults only.
unset MINIO_IMAGE MC_IMAGE MINIO_ROOT_USER MINIO_ROOT_PASSWORD CACHED_CACHE_CAPACITY \
      CACHED_PREFETCH_LOOKAHEAD TORCH_SPEC TORCH_INDEX_URL COMPOSE_FILE COMPOSE_PROFILES

checked=()
for files in "docker-compose.yml" "docker-compose.yml deploy/compose/s3-moto.yml" \
    "docker-compose.yml deploy/compose/s3-rgw.yml"; do
    args=()
    for f in $files; do args+=(-f "$f"); done
    # COMPOSE_PROFILES=tools: Compose v2 checks the `tools` service (mc) only when its
    # profile is active; v1 checks every service anyway.
    if ! out=$(COMPOSE_PROFILES=tools "$compose" "${args[@]}" config -q 2>&1); then
        echo "compose-config: FAILED: $compose ${args[*]} config" >&2
        echo "$out" >&2
        exit 1
    fi
    checked+=("$files")
done
version=$("$compose" version --short 2>/dev/null || echo '?')
echo "compose-config: ok ($compose $version config: $(IFS=';'; echo "${checked[*]}"))"
