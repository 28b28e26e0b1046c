#!/usr/bin/env bash
# `make compose-check`: the docker-compose stack of docker-compose.yml run for real, on
# Debian's docker engine (docker.io) and docker-compose, with Ceph's RADOS Gateway in place
# of MinIO (deploy/compose/s3-rgw.yml): no image is pulled from anywhere. Every image is
# built on a local base, a Debian root made by debootstrap (as `make deploy-check` makes
# its root, cached beside it) and imported with `docker import`; what the builds install
# comes from the Debian archive and the Python package index. Then `up`, and one PASS/FAIL
# line each:
#   - build: the four images (daemon, trainer, RGW; dataset-init runs the daemon's);
#   - dataset-init exits 0 (the bucket and 8 shards x 64 samples written into RGW);
#   - the trainer exits 0 after 3 epochs, each of every sample;
#   - the daemon's /metrics: it served every sample of the 3 epochs, every byte of them
#     read by the trainer from the hot tier's files (local reads: the cache volume mounted
#     read-only in the trainer), none sent back through the socket;
#   - stop: the daemon exits 0 on SIGTERM.
# The engine is a dockerd of its own, started here and stopped at the end: its data under
# $CACHED_DEPLOY_CHECK_CACHE/docker (the images stay, so a second run rebuilds only what
# changed), its sockets and state in a temporary directory under /run; it neither touches
# the host's firewall (--iptables=false) nor publishes ports on the host
# (--userland-proxy=false), so the stack's ports cannot clash with anything. The stack's
# containers, network and volumes are removed at the end, pass or fail.
# Needs root, dockerd, docker, docker-compose (or `docker compose`) and debootstrap; where
# they are missing, or the engine cannot start or run a container, it says why in one line
# and exits 0. Exit status 1 when any check failed.
#
# Large things live only under $CACHED_DEPLOY_CHECK_CACHE (default
# /var/cache/cached-deploy-check): root-<suite>-<hash of the package list> (the debootstrap
# result, about 280 MB), torch-<hash of $TORCH> (the trainer's torch wheel, downloaded on
# the host with the host's pip settings, as `make demo` gets it, and handed to the build
# over HTTP on loopback) and docker/ (the engine's images and build cache: a few GB; the
# untagged images of earlier builds are pruned after a day, or at once past 8 GiB).
# Delete the directory, or its docker/, to rebuild.
set -Eeuo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cache=${CACHED_DEPLOY_CHECK_CACHE:-/var/cache/cached-deploy-check}
py=${PY:-$repo/.venv/bin/python}   # the project's venv: pip downloads the torch wheel
torch_spec=${TORCH:-torch==2.13.0}   # the Makefile's TORCH: the CPU wheel
# The base's root: Python with venv (and its bundled pip); minbase has passwd (useradd),
# apt (the RGW image) and bash.
packages=(python3 python3-venv)
project="cached-compose-check"
# The example dataset and epochs of docker-compose.yml (x-dataset, the trainer's).
shards=8
per_shard=64
epochs=3

# --- output ------------------------------------------------------------------------------
failures=0
started=$EPOCHREALTIME
log() { printf '%s\n' "compose-check: $*"; }
# pass, fail, indent, since; read_apt_source, remove_tree, ensure_root: shared with
# deploy/check/systemd.sh (the same Debian root, in the same cache).
# shellcheck source=deploy/check/lib.sh
. "$repo/deploy/check/lib.sh"
skip() {
    echo "compose-check: skipped ($*): the compose stack was not run"
    exit 0
}

# --- preconditions -----------------------------------------------------------------------
# Debian's engine (docker.io: dockerd, containerd, runc) and docker-compose, installed when
# missing and this is root with apt-get, as deploy/check/system-deps.sh installs the other
# tools. The package's own services are not started (a policy-rc.d for the install, where
# there is none): this check starts a dockerd of its own, and the host's firewall stays as
# it is.
install_engine() {
    local want=()
    command -v dockerd >/dev/null || want+=(docker.io)
    command -v docker-compose >/dev/null || want+=(docker-compose)
    [ ${#want[@]} -gt 0 ] && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null || return 0
    log "installing ${want[*]}"
    local policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 0755 "$policy"
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${want[@]}" >/dev/null 2>&1 ||
        { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "${want[@]}" >/dev/null 2>&1; } || log "apt-get install ${want[*]} failed"
    [ -n "$policy" ] && rm -f "$policy"
    return 0
}

skip_unless_possible() {
    install_engine
    local missing=() tool
    [ "$(id -u)" -eq 0 ] || missing+=("not root")
    for tool in dockerd docker debootstrap findmnt flock; do
        command -v "$tool" >/dev/null || missing+=("no $tool")
    done
    if command -v docker >/dev/null && docker compose version >/dev/null 2>&1; then
        compose_cmd=(docker compose)
    elif command -v docker-compose >/dev/null; then
        compose_cmd=(docker-compose)
    else
        missing+=("no docker compose or docker-compose")
    fi
    "$py" -m pip --version >/dev/null 2>&1 || missing+=("no pip in $py")
    if [ ${#missing[@]} -gt 0 ]; then
        local why
        why=$(printf '%s, ' "${missing[@]}")
        skip "${why%, }"
    fi
}

# --- the engine ---------------------------------------------------------------------------
# A dockerd of its own (see the header). Its containerd, started by it, lives in the same
# temporary state directory. The probe runs /bin/true of this host, with its libraries, as
# a container: where the engine starts but cannot run containers, the check skips.
start_engine() {
    engine=$(mktemp -d /run/cached-compose-check.XXXXXX)
    mkdir -p "$cache/docker"
    setsid dockerd --data-root "$cache/docker" --exec-root "$engine/exec" \
        --pidfile "$engine/dockerd.pid" -H "unix://$engine/docker.sock" \
        --iptables=false --ip-masq=false --userland-proxy=false --bridge=none \
        --containerd-namespace "$project" --containerd-plugins-namespace "$project-plugins" \
        </dev/null >"$work/dockerd.log" 2>&1 9>&- &
    dockerd_pid=$!
    export DOCKER_HOST=unix://$engine/docker.sock
    local t0=$EPOCHREALTIME
    for _ in $(seq 600); do
        docker version --format '{{.Server.Version}}' >/dev/null 2>&1 && break
        kill -0 "$dockerd_pid" 2>/dev/null || break
        sleep 0.1
    done
    if ! server=$(docker version --format '{{.Server.Version}}' 2>/dev/null); then
        local why
        why=$(grep -E 'level=(fatal|error)|^failed' "$work/dockerd.log" | tail -n 1 | sed 's/^time="[^"]*" //')
        skip "dockerd did not start: ${why:-no answer within 60 s}"
    fi
    log "engine: dockerd $server ($(docker info --format '{{.Driver}}') storage) ready in $(since "$t0") s; ${compose_cmd[*]} $("${compose_cmd[@]}" version --short 2>/dev/null || true)"
    local probe=$work/probe lib out
    mkdir -p "$probe/bin"
    cp /bin/true "$probe/bin/true"
    for lib in $(ldd /bin/true | grep -o '/[^ ]*'); do
        mkdir -p "$probe$(dirname "$lib")"
        cp -L "$lib" "$probe$lib"
    done
    if ! out=$(tar -C "$probe" -c . | docker import - cached-compose-probe:latest 2>&1 >/dev/null &&
        timeout 60 docker run --rm --network none cached-compose-probe:latest /bin/true 2>&1); then
        skip "the engine cannot run a container: $(printf '%s' "$out" | tail -n 1)"
    fi
}

stop_engine() {
    [ -n "${dockerd_pid:-}" ] || return 0
    kill -TERM "$dockerd_pid" 2>/dev/null
    for _ in $(seq 300); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$dockerd_pid" 2>/dev/null
    wait "$dockerd_pid" 2>/dev/null
    dockerd_pid=""
}

# --- the base image ------------------------------------------------------------------------
# The root imported as is (once per root), then one layer on top: the host's CA bundle and
# an /etc/pip.conf that makes pip trust it, so that pip in the builds reaches the package
# index wherever the host does (a TLS-inspecting proxy included).
ensure_base() {
    local t0=$EPOCHREALTIME
    local raw=cached-base-root:${root##*/root-}
    if ! docker image inspect "$raw" >/dev/null 2>&1; then
        tar --numeric-owner -C "$root" -c . | docker import - "$raw" >/dev/null
    fi
    local ctx=$work/base bundle
    mkdir -p "$ctx"
    bundle=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
    {
        echo "FROM $raw"
        echo "ENV LANG=C.UTF-8"
        if [ -f "$bundle" ]; then
            cp "$bundle" "$ctx/ca-certificates.crt"
            printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$ctx/pip.conf"
            echo "COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt"
            echo "COPY pip.conf /etc/pip.conf"
        fi
    } >"$ctx/Dockerfile"
    base=cached-base:$suite
    if ! out=$(DOCKER_BUILDKIT=0 docker build -q -t "$base" "$ctx" 2>&1); then
        printf '%s\n' "$out" | tail -n 20 | indent
        fail "base image: docker build failed (output above)"
        exit 1
    fi
    log "base: $base from $root in $(since "$t0") s"
}

# --- torch for the trainer -----------------------------------------------------------------
# The wheel of $TORCH for the root's Python, downloaded once with the host's pip settings
# and served on loopback (the builds use the host's network): TORCH_SPEC is its URL. The
# port stays the same from run to run where it is free, so the build cache holds.
ensure_torch() {
    local key pyver arch plat=() m whl
    pyver=$(chroot "$root" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    arch=$(uname -m)
    key=$(printf '%s\n' "$torch_spec" "$pyver" "$arch" | sha256sum | cut -c1-12)
    torch_dir=$cache/torch-$key
    if [ ! -d "$torch_dir" ]; then
        local t0=$EPOCHREALTIME glibc
        glibc=$(chroot "$root" getconf GNU_LIBC_VERSION | awk '{ split($2, v, "."); print v[2] }')
        for m in $(seq "$glibc" -1 17); do plat+=(--platform "manylinux_2_${m}_$arch"); done
        plat+=(--platform "manylinux2014_$arch" --platform "linux_$arch")
        building=$(mktemp -d "$cache/.build-torch-XXXXXX")
        if ! "$py" -m pip download -q --disable-pip-version-check --no-deps -d "$building" \
            --only-binary=:all: --implementation cp --python-version "$pyver" "${plat[@]}" \
            "$torch_spec" >"$building.log" 2>&1; then
            tail -n 20 "$building.log" | indent
            fail "pip download of $torch_spec failed (output above)"
            exit 1
        fi
        rm -f "$building.log"
        chmod 0755 "$building"
        mv -T "$building" "$torch_dir" 2>/dev/null || rm -rf "$building"
        building=""
        log "torch: $torch_spec downloaded in $(since "$t0") s into $torch_dir"
    fi
    for whl in "$torch_dir"/*.whl; do break; done
    whl=${whl##*/}
    local port=${CACHED_COMPOSE_CHECK_WHEEL_PORT:-39465}
    if ! "$py" -c 'import socket, sys; socket.create_server(("127.0.0.1", int(sys.argv[1])))' "$port" 2>/dev/null; then
        port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    fi
    "$py" -m http.server --bind 127.0.0.1 --directory "$torch_dir" "$port" >"$work/wheels.log" 2>&1 9>&- &
    wheel_pid=$!
    torch_url="http://127.0.0.1:$port/$("$py" -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1]))' "$whl")"
    for _ in $(seq 100); do
        "$py" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1).close()' "$torch_url" 2>/dev/null && break
        sleep 0.1
    done
    log "torch: $whl served at $torch_url"
}

# --- the stack ------------------------------------------------------------------------------
# docker-compose.yml, RGW in MinIO's place, and this check's own override: every build on
# the local base, on the host's network (the engine has no NAT: --iptables=false).
write_override() {
    cat >"$work/local-base.yml" <<EOF
x-local-base: &local-base
  network: host
  args:
    BASE: $base
services:
  minio: {build: *local-base}
  dataset-init: {build: *local-base}
  cached: {build: *local-base}
  trainer: {build: *local-base}
EOF
    compose_files=(-f "$repo/docker-compose.yml" -f "$repo/deploy/compose/s3-rgw.yml"
        -f "$work/local-base.yml")
}

compose() {
    timeout --kill-after=10 "${T:-300}" env TORCH_SPEC="$torch_url" TORCH_INDEX_URL= \
        CACHED_CACHE_CAPACITY=1GiB CACHED_PREFETCH_LOOKAHEAD=256MiB \
        "${compose_cmd[@]}" --project-name "$project" --project-directory "$repo" \
        "${compose_files[@]}" "$@"
}

container() { compose ps -q "$1" 2>/dev/null | head -n 1; }
exit_code() {
    local id
    id=$(container "$1")
    [ -n "$id" ] && docker inspect -f '{{.State.ExitCode}}' "$id" 2>/dev/null
}
service_logs() { compose logs --no-color --tail "${2:-25}" "$1" 2>&1 | indent || true; }

build_images() {
    local t0=$EPOCHREALTIME
    if ! T=3600 compose build >"$work/build.log" 2>&1; then
        tail -n 30 "$work/build.log" | indent
        fail "build: docker-compose build failed (output above)"
        exit 1
    fi
    local steps cached
    steps=$(grep -c '^Step [0-9]' "$work/build.log" || true)
    cached=$(grep -c 'Using cache' "$work/build.log" || true)
    pass "build: cached:0.1.0, cached-trainer:0.1.0, cached-rgw:0.1.0 on $base in $(since "$t0") s ($cached of $steps steps from the build cache)"
}

run_stack() {
    local t0=$EPOCHREALTIME rc=0
    # -d: up returns once the trainer has started (after RGW is healthy, dataset-init has
    # exited 0 and the daemon is healthy: the depends_on conditions); then wait for it.
    T=600 compose up -d --no-build >"$work/up.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        tail -n 15 "$work/up.log" | indent
        fail "up: docker-compose up failed (exit $rc, output above)"
        local s
        for s in minio dataset-init cached; do
            echo "      | --- $s:"
            service_logs "$s" 15
        done
    else
        log "up: returned in $(since "$t0") s (RGW healthy, dataset-init done, daemon healthy)"
    fi

    local init_rc
    init_rc=$(exit_code dataset-init || true)
    if [ "$init_rc" = 0 ]; then
        pass "dataset-init: exit 0; $(compose logs --no-color dataset-init 2>&1 | grep -o 'make-dataset: s3://.*' | tail -n 1)"
    else
        fail "dataset-init: exit '${init_rc:-no container}'"
        service_logs dataset-init
        return
    fi
    [ "$rc" -eq 0 ] || return

    local trainer code
    trainer=$(container trainer)
    if [ -z "$trainer" ]; then
        fail "trainer: no container"
        return
    fi
    code=$(timeout 600 docker wait "$trainer" 2>&1) || code="timeout (600 s)"
    local out lines
    out=$(docker logs "$trainer" 2>&1 || true)
    lines=$(grep -c "^trainer: epoch [0-9]*: $((shards * per_shard)) samples" <<<"$out" || true)
    if [ "$code" = 0 ] && [ "$lines" -eq "$epochs" ] && grep -q '^trainer: done' <<<"$out"; then
        pass "trainer: exit 0 after $epochs epochs of $((shards * per_shard)) samples ($(since "$t0") s after up)"
        grep '^trainer: epoch' <<<"$out" | indent
    else
        fail "trainer: exit '$code', $lines of $epochs epochs with every sample"
        printf '%s\n' "$out" | tail -n 25 | indent
        echo "      | --- cached:"
        service_logs cached 15
    fi
}

# The daemon's Prometheus endpoint, read inside its container (no port on the host).
metric() {
    awk -v m="$1" '$1 == m || index($1, m "{") == 1 { s += $NF } END { printf "%.0f", s }' "$work/metrics.txt"
}
check_metrics() {
    if ! T=30 compose exec -T cached python -c 'import sys, urllib.request
sys.stdout.write(urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=5).read().decode())' \
        >"$work/metrics.txt" 2>"$work/metrics.err"; then
        fail "metrics: GET /metrics in the daemon's container failed: $(tail -n 1 "$work/metrics.err")"
        return
    fi
    local samples served local_read fallback fetched want errors
    samples=$(metric cached_served_samples_total)
    served=$(metric cached_served_bytes_total)
    local_read=$(metric cached_local_read_bytes_total)
    fallback=$(metric cached_local_fallback_bytes_total)
    fetched=$(metric cached_fetched_bytes_total)
    # unknown_dataset is no failure: the daemon asks the first reader of a dataset for its
    # URL list (docs/protocol.md, "Datasets").
    errors=$(awk '/^cached_requests_total\{/ && !/result="(ok|unknown_dataset)"/ { s += $NF } END { printf "%.0f", s }' "$work/metrics.txt")
    want=$((shards * per_shard * epochs))
    local summary="served $samples samples ($served bytes), local reads $local_read bytes, fallback $fallback, fetched from RGW $fetched bytes, failed requests $errors"
    if [ "$samples" -eq "$want" ] && [ "$local_read" -gt 0 ] && [ "$local_read" -eq "$served" ] &&
        [ "$fallback" -eq 0 ] && [ "$fetched" -gt 0 ] && [ "$errors" -eq 0 ]; then
        pass "metrics: every sample served ($want), every byte read by the trainer from the hot tier's files: $summary"
    else
        fail "metrics: want $want samples, all bytes as local reads, no fallback, no failed request: $summary"
        grep -E '^cached_(served|local|fetched|requests_total|hits|misses)' "$work/metrics.txt" | indent
    fi
}

check_stop() {
    local rc=0 code
    T=60 compose stop -t 30 cached >/dev/null 2>&1 || rc=$?
    code=$(exit_code cached || true)
    if [ "$rc" -eq 0 ] && [ "$code" = 0 ]; then
        pass "stop: the daemon exited 0 on SIGTERM"
    else
        fail "stop: docker-compose stop exit $rc, the daemon's exit code '$code'"
        service_logs cached 15
    fi
}

cleanup() {
    local rc=$?
    set +e
    trap - ERR
    if [ -n "${compose_files:-}" ] && [ -n "${dockerd_pid:-}" ]; then
        T=120 compose down -v --remove-orphans -t 10 >/dev/null 2>&1 ||
            log "cleanup: docker-compose down failed"
        # Untagged images a day old: those of earlier builds that no tag names any more (a
        # changed source tree). Not younger ones: the classic builder's cache of each
        # Dockerfile's `build` stage is such an image too, and the next run reuses it.
        docker image prune -f --filter until=24h >/dev/null 2>&1
        # And all of them when the engine's data has grown past 8 GiB (many changes in a
        # day): the next run then rebuilds the `build` stages.
        local mb
        mb=$(du -sm "$cache/docker" 2>/dev/null | cut -f1)
        if [ "${mb:-0}" -gt 8192 ]; then
            docker image prune -f >/dev/null 2>&1
        fi
    fi
    stop_engine
    if [ -n "${wheel_pid:-}" ]; then
        kill -TERM "$wheel_pid" 2>/dev/null
        wait "$wheel_pid" 2>/dev/null
    fi
    stop_debootstrap
    [ -n "${building:-}" ] && remove_tree "$building" && rm -f "$building.log"
    [ -n "${engine:-}" ] && remove_tree "$engine"
    [ -n "${work:-}" ] && rm -rf "$work"
    exit "$rc"
}

on_error() {
    fail "unexpected error (exit $1) at line $2: $3"
}

main() {
    skip_unless_possible
    mkdir -p "$cache"
    # One run at a time: the engine's data directory is the cache's.
    exec 9>"$cache/compose-check.lock"
    if ! flock -w 1800 9; then
        fail "another compose-check held $cache/compose-check.lock for 30 minutes"
        exit 1
    fi
    work=$(mktemp -d)
    trap cleanup EXIT
    trap 'exit 130' INT TERM
    trap 'on_error $? $LINENO "$BASH_COMMAND"' ERR
    start_engine
    read_apt_source
    ensure_root
    ensure_base
    ensure_torch
    write_override
    build_images
    run_stack
    if [ "$failures" -eq 0 ]; then
        check_metrics
        check_stop
    fi
    finish
}

main "$@"
