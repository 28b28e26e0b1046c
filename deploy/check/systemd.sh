#!/usr/bin/env bash
# `make deploy-check`: the systemd unit exactly as shipped (deploy/systemd/cached.service),
# installed the way docs/operations.md says (deploy/systemd/install.sh), run under a real
# systemd. systemd-nspawn boots a minimal Debian root (debootstrap, cached outside the
# repository) with a throwaway overlay on top; moto's S3 server runs on the host's loopback,
# which the container shares. Checks, one PASS/FAIL line each:
#   - the install: the files and modes the docs list, the system user and group `cached`
#     (sysusers.d);
#   - the upgrade from the DynamicUser= unit of earlier versions (its hot tier under
#     /var/cache/private, socket 0666, local reads off): its shards are kept and read
#     under the new unit with nothing fetched again;
#   - start: Type=notify reaches active (ready), with a STATUS= line; /metrics has the
#     process collector;
#   - access under the unit as shipped: the socket srw-rw---- cached:cached in a 0750
#     /run/cached (set by the daemon whatever the umask; UMask=0077), the hot tier a 0750
#     directory of 0640 shards with nothing for others; a user admitted with `usermod -aG
#     cached` reads every shard from the files themselves (local reads required;
#     cached_local_read_bytes_total > 0 on /metrics), a user outside the group can
#     neither connect nor open a shard file;
#   - SIGKILL: Restart=on-failure brings it back with the hot tier warm (no S3 fetch);
#   - stop: clean (Result=success) within TimeoutStopSec;
#   - the any-local-user drop-in (deploy/systemd/any-local-user.conf): srw-rw-rw- in a
#     0755 directory, the non-member reads through the socket, the member still from the
#     files, the shard files still the group's.
# Needs root, systemd-nspawn, debootstrap and nsenter; without them it says so in one line
# and exits 0. Exit status 1 when any check failed.
#
# Large things live only under $CACHED_DEPLOY_CHECK_CACHE (default
# /var/cache/cached-deploy-check): root-<suite>-<hash of the package list> (the debootstrap
# result, about 300 MB, reused while the package list and suite stay the same) and
# wheels-<python>-<hash of the requirements> (the daemon's dependencies as wheels, so the
# container installs without reaching a package index). Delete the directory to rebuild.
set -Eeuo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cache=${CACHED_DEPLOY_CHECK_CACHE:-/var/cache/cached-deploy-check}
py=${PY:-$repo/.venv/bin/python}   # the project's venv: moto, boto3, the package itself
# The root: systemd as init, python3 with venv for the install, libnss-systemd so that
# systemd-managed names resolve (what a normal Debian install has through recommends);
# minbase already has passwd (useradd) and util-linux (runuser).
packages=(systemd systemd-sysv dbus libnss-systemd python3 python3-venv)

# --- output ------------------------------------------------------------------------------
failures=0
started=$EPOCHREALTIME
log() { printf '%s\n' "deploy-check: $*"; }
# pass, fail, indent, since; read_apt_source, remove_tree, ensure_root: shared with
# deploy/check/compose.sh, which builds its base image from the same root.
# shellcheck source=deploy/check/lib.sh
. "$repo/deploy/check/lib.sh"

# --- preconditions -----------------------------------------------------------------------
skip_unless_possible() {
    local missing=() tool
    [ "$(id -u)" -eq 0 ] || missing+=("not root")
    for tool in systemd-nspawn debootstrap nsenter pgrep findmnt; do
        command -v "$tool" >/dev/null || missing+=("no $tool")
    done
    "$py" -c 'import moto, boto3' 2>/dev/null || missing+=("no moto in $py")
    if [ ${#missing[@]} -gt 0 ]; then
        local why
        why=$(printf '%s, ' "${missing[@]}")
        echo "deploy-check: skipped (${why%, }): the systemd unit was not run"
        exit 0
    fi
}

# --- the daemon's dependencies as wheels, downloaded on the host -------------------------
# The container then installs with PIP_NO_INDEX: no package index reachable from inside
# needed (nor its TLS setup), and a warm run downloads nothing. The requirements are read
# from the two pyproject.toml files (cached-client itself is installed from the source),
# plus the build backend; wheels for the root's Python and glibc, whatever the host's are.
ensure_wheels() {
    local reqs pyver glibc arch key plat=() m
    reqs=$("$py" - "$repo" <<'PY'
import sys, tomllib
src = sys.argv[1]
for project in ("client", "."):
    with open(f"{src}/{project}/pyproject.toml", "rb") as f:
        meta = tomllib.load(f)
    deps = meta["project"]["dependencies"] + meta["build-system"]["requires"]
    print("\n".join(d for d in deps if not d.replace(" ", "").startswith("cached-client")))
PY
)
    pyver=$(chroot "$root" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    glibc=$(chroot "$root" getconf GNU_LIBC_VERSION | awk '{ split($2, v, "."); print v[2] }')
    arch=$(uname -m)
    key=$(printf '%s\n' "$reqs" "$pyver" "$glibc" "$arch" | sha256sum | cut -c1-12)
    wheels=$cache/wheels-$pyver-$key
    if [ -d "$wheels" ]; then
        log "wheels: $wheels (cached)"
        return
    fi
    # pip does not widen one --platform to older manylinux tags: list them all.
    for m in $(seq "$glibc" -1 17); do plat+=(--platform "manylinux_2_${m}_$arch"); done
    plat+=(--platform "manylinux2014_$arch" --platform "linux_$arch")
    local t0=$EPOCHREALTIME
    building=$(mktemp -d "$cache/.build-wheels-XXXXXX")
    printf '%s\n' "$reqs" >"$building.reqs"
    if ! "$py" -m pip download -q --disable-pip-version-check -d "$building" \
        --only-binary=:all: --implementation cp --python-version "$pyver" "${plat[@]}" \
        -r "$building.reqs" >"$building.log" 2>&1; then
        tail -n 20 "$building.log" | indent
        fail "pip download of the daemon's dependencies failed (output above)"
        exit 1
    fi
    rm -f "$building.reqs" "$building.log"
    chmod 0755 "$building"
    mv -T "$building" "$wheels" 2>/dev/null || rm -rf "$building"   # a concurrent run won
    building=""
    log "wheels: downloaded in $(since "$t0") s into $wheels ($(find "$wheels" -name "*.whl" | wc -l) wheels)"
}

# --- moto on the host ---------------------------------------------------------------------
start_s3() {
    "$py" "$repo/deploy/check/systemd_check.py" s3 "$work" >"$work/s3.log" 2>&1 &
    s3_pid=$!
    for _ in $(seq 300); do
        [ -e "$work/requests.json" ] && break
        kill -0 "$s3_pid" 2>/dev/null || break
        sleep 0.1
    done
    if [ ! -e "$work/requests.json" ]; then
        tail -n 20 "$work/s3.log" | indent
        fail "moto's S3 server did not start (log above)"
        exit 1
    fi
    endpoint=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["endpoint"])' "$work/s3.json")
}

# GETs of shard keys that moto has answered so far (refreshed every 0.2 s by the helper).
shard_gets() {
    sleep 0.5
    "$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["shard_gets"])' "$work/requests.json"
}

# --- the container ------------------------------------------------------------------------
# --volatile=overlay: the cached root is the read-only lower layer of an overlay whose upper
# layer is a tmpfs, so every run starts from the same clean root and leaves it untouched (no
# copy). --register=no --keep-unit: the host needs no systemd (machinectl does not see the
# container; commands go in with nsenter). The network is the host's: moto on 127.0.0.1.
boot() {
    systemd-nspawn -b --register=no --keep-unit --volatile=overlay -D "$root" \
        --machine="cached-check-$$" --console=read-only \
        --bind-ro="$repo:/src" --bind-ro="$wheels:/wheels" --bind-ro="$work/share:/check" \
        </dev/null >"$work/boot.log" 2>&1 &
    nspawn_pid=$!
    local t0=$EPOCHREALTIME
    for _ in $(seq 300); do   # the container's init: the child of nspawn
        leader=$(pgrep -P "$nspawn_pid" -x systemd || true)
        [ -n "$leader" ] && break
        kill -0 "$nspawn_pid" 2>/dev/null || break
        sleep 0.1
    done
    local state=""
    # Right after init starts, systemctl may find no bus yet ("Failed to connect to bus",
    # no state printed), or no /run/systemd/system yet ("offline": seen once in CI under
    # load): ask again until it answers (then --wait waits for the boot).
    for _ in $(seq 100); do
        [ -n "$leader" ] || break
        state=$(T=120 in_container systemctl is-system-running --wait 2>/dev/null || true)
        [ -n "$state" ] && [ "$state" != offline ] && break
        kill -0 "$nspawn_pid" 2>/dev/null || break
        sleep 0.2
    done
    if [ -z "$leader" ] || { [ "$state" != running ] && [ "$state" != degraded ]; }; then
        tail -n 30 "$work/boot.log" | indent
        fail "the container did not boot (state '${state}'; boot log above)"
        exit 1
    fi
    log "container booted in $(since "$t0") s ($state)"
    if [ "$state" = degraded ]; then
        in_container systemctl --failed --no-legend | indent
    fi
}

# A command inside the booted container, with a clean environment and a time limit
# (T seconds, default 60) so that nothing can hang the check.
in_container() {
    timeout --kill-after=5 "${T:-60}" nsenter -t "$leader" -a \
        env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 "$@"
}
prop() { in_container systemctl show -p "$1" --value cached; }

# Read the shards through the daemon as USER; prints the reader's line, returns its status.
# read_as USER [--local on|off|auto]: read every shard as USER (systemd_check.py read).
read_as() {
    local user=$1
    shift
    in_container runuser -u "$user" -- /opt/cached/bin/python /check/systemd_check.py read \
        /check/manifest.json "$@"
}

# What is wrong, for the log of a failed check.
diagnose() {
    in_container systemctl status --no-pager -l cached 2>&1 | tail -n 15 | indent || true
    in_container journalctl -u cached -b --no-pager -n 25 2>&1 | indent || true
}

cleanup() {
    local rc=$?
    set +e
    trap - ERR   # what fails here (a process already gone) is expected
    if [ -n "${nspawn_pid:-}" ] && kill -0 "$nspawn_pid" 2>/dev/null; then
        [ -n "${leader:-}" ] && T=15 in_container systemctl poweroff >/dev/null 2>&1
        for _ in $(seq 150); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.1; done
        # nspawn turns SIGTERM into a poweroff of the container; SIGKILL is the last resort.
        kill -TERM "$nspawn_pid" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$nspawn_pid" 2>/dev/null
        wait "$nspawn_pid" 2>/dev/null
    fi
    if [ -n "${s3_pid:-}" ]; then
        kill -TERM "$s3_pid" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$s3_pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$s3_pid" 2>/dev/null
        wait "$s3_pid" 2>/dev/null
    fi
    stop_debootstrap
    [ -n "${building:-}" ] && remove_tree "$building" && rm -f "$building".{log,reqs}
    [ -n "${work:-}" ] && rm -rf "$work"
    exit "$rc"
}

# --- checks -------------------------------------------------------------------------------
# The install of the docs: deploy/systemd/install.sh, run by root inside the booted system
# (systemd running: it reloads and enables). Then the operator's edits: the config points
# at moto, with a small hot tier and a free HTTP port (the host's network is shared); the
# socket stays the default. Credentials go into /etc/cached/env.
check_install() {
    local t0=$EPOCHREALTIME out
    if ! out=$(T=600 in_container env PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels \
        /src/deploy/systemd/install.sh 2>&1); then
        printf '%s\n' "$out" | tail -n 20 | indent
        fail "install: deploy/systemd/install.sh failed (output above)"
        exit 1
    fi
    local took
    took=$(since "$t0")
    local http_port
    http_port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    in_container sh -c 'cat > /etc/cached/config.toml' <<EOF
[server]
http = "127.0.0.1:$http_port"

[cache]
capacity = "64MiB"
min_free = "16MiB"

[s3]
endpoint_url = "$endpoint"
EOF
    printf 'AWS_ACCESS_KEY_ID=deploy-check\nAWS_SECRET_ACCESS_KEY=deploy-check\n' |
        in_container sh -c 'cat > /etc/cached/env'
    metrics_url="http://127.0.0.1:$http_port/metrics"
    local modes enabled
    modes=$(in_container stat -c '%a %U:%G %n' /etc/cached/config.toml /etc/cached/env | paste -sd, -)
    enabled=$(in_container systemctl is-enabled cached || true)
    if [ "$(in_container readlink /usr/local/bin/cached)" = /opt/cached/bin/cached ] &&
        in_container /usr/local/bin/cached --version >/dev/null &&
        [ "$modes" = "644 root:root /etc/cached/config.toml,600 root:root /etc/cached/env" ] &&
        [ "$enabled" = enabled ]; then
        pass "install: install.sh in ${took} s; /usr/local/bin/cached -> /opt/cached; $modes; $enabled"
    else
        fail "install: symlink, modes or enable wrong: $modes; $enabled"
    fi
    # The daemon's environment: no torch (cached-client's torch is an extra the daemon does
    # not ask for), and every requirement met (install-daemon.sh ran pip check too).
    local deps
    if deps=$(in_container /opt/cached/bin/python -m pip check --disable-pip-version-check 2>&1) &&
        in_container /opt/cached/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is not None)'; then
        pass "daemon environment: no torch; pip check: $deps"
    else
        fail "daemon environment: torch installed, or pip check failed: $deps"
    fi
    # The static user of the unit (User=cached), made by systemd-sysusers from the shipped
    # file: a system uid (below the login range) and its own group.
    local sysusers pw gr uid gid shell
    sysusers=$(in_container stat -c '%a %U:%G %n' /usr/local/lib/sysusers.d/cached.conf 2>&1 || true)
    pw=$(in_container getent passwd cached || true)
    gr=$(in_container getent group cached || true)
    IFS=: read -r _ _ uid gid _ _ shell <<<"$pw"
    if [ "$sysusers" = "644 root:root /usr/local/lib/sysusers.d/cached.conf" ] &&
        [ -n "$uid" ] && [ "$uid" -lt 1000 ] && [ "$uid" -gt 0 ] &&
        [ "$(cut -d: -f3 <<<"$gr")" = "$gid" ] && [[ $shell == */nologin ]]; then
        pass "system user: $sysusers; $pw; group $gr"
    else
        fail "system user: sysusers file '$sysusers', passwd '$pw', group '$gr'; want a system uid and its group cached"
    fi
}

# An install that ran the DynamicUser= unit of earlier versions, upgraded: before the
# static user existed, the old unit's settings (a drop-in on the shipped unit) ran the
# daemon as a transient `cached`, its hot tier /var/cache/private/cached, 0600 shards,
# socket 0666; bob (anyone) read through it. Then the upgrade: the drop-in gone, the user
# made again by systemd-sysusers as install.sh does. check_start starts the new unit;
# check_access then finds the same shards, moved by systemd to /var/cache/cached and
# opened to the group by the daemon, and reads them without a fetch.
check_old_unit() {
    in_container userdel cached
    in_container groupdel cached 2>/dev/null || true
    in_container mkdir -p /etc/systemd/system/cached.service.d
    in_container sh -c 'cat > /etc/systemd/system/cached.service.d/old.conf' <<'EOF2'
[Service]
DynamicUser=yes
CacheDirectoryMode=0700
RuntimeDirectoryMode=0755
Environment=CACHED_SERVER_SOCKET_MODE=0666
Environment=CACHED_SERVER_LOCAL_READS=false
EOF2
    in_container systemctl daemon-reload
    in_container useradd --no-create-home --shell /usr/sbin/nologin bob
    local rc=0 out="" kind=""
    T=90 in_container systemctl start cached || rc=$?
    [ "$rc" -eq 0 ] && { out=$(read_as bob 2>&1) || rc=$?; }
    kind=$(in_container stat -c '%F %a' /var/cache/private/cached 2>&1 || true)
    T=45 in_container systemctl stop cached || true
    in_container rm /etc/systemd/system/cached.service.d/old.conf
    in_container systemctl daemon-reload
    in_container systemd-sysusers cached.conf >/dev/null 2>&1
    old_gets=$(shard_gets)
    if [ "$rc" -eq 0 ] && [ "$kind" = "directory 700" ]; then
        log "the old unit (DynamicUser=yes): /var/cache/private/cached $kind; bob read: $out"
    else
        fail "the old unit (DynamicUser=yes) did not serve (exit $rc): $out; /var/cache/private/cached '$kind'"
        diagnose
    fi
}

check_start() {
    local t0=$EPOCHREALTIME rc=0
    T=90 in_container systemctl start cached || rc=$?
    local took active
    took=$(since "$t0")
    active=$(in_container systemctl is-active cached || true)
    local exec_us ready_us
    exec_us=$(prop ExecMainStartTimestampMonotonic)
    ready_us=$(prop ActiveEnterTimestampMonotonic)
    if [ "$rc" -eq 0 ] && [ "$active" = active ]; then
        pass "start: active after systemctl start returned in ${took} s" \
            "(exec to READY=1: $(awk -v a="$exec_us" -v b="$ready_us" 'BEGIN { printf "%.2f", (b - a) / 1e6 }') s)"
    else
        fail "start: systemctl start exited $rc after ${took} s, unit is '$active'"
        diagnose
        return 1
    fi
    log "journalctl -u cached -b (the start):"
    in_container journalctl -u cached -b --no-pager -o short-monotonic | head -n 20 | indent
    local status
    status=$(prop StatusText)
    # The daemon sends STATUS= with READY=1 and refreshes it while it runs.
    if [[ $status == serving* ]]; then
        pass "status: StatusText=$status"
    else
        fail "status: StatusText='$status', want the daemon's \"serving: ...\" line"
    fi
    local metrics
    metrics=$(in_container /opt/cached/bin/python -c \
        'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' \
        "$metrics_url" 2>&1 || true)
    if grep -q '^process_start_time_seconds ' <<<"$metrics"; then
        pass "metrics: $(grep '^process_start_time_seconds ' <<<"$metrics") ($metrics_url, from inside)"
    else
        fail "metrics: no process_start_time_seconds on $metrics_url"
        head -n 5 <<<"$metrics" | indent
    fi
}

# WatchdogSec=60s: systemd passes WATCHDOG_USEC, and the daemon's event loop pings every
# 5 s (its STATUS= period, shorter than half the watchdog). systemd records each ping in
# WatchdogTimestamp: it must move while the daemon runs, or a healthy daemon would be
# killed after a minute.
check_watchdog() {
    local first now tries=0 t0=$EPOCHREALTIME
    first=$(prop WatchdogTimestampMonotonic)
    now=$first
    while [ "$now" = "$first" ] && [ "$tries" -lt 60 ]; do   # 12 s: two ping periods and more
        sleep 0.2
        tries=$((tries + 1))
        now=$(prop WatchdogTimestampMonotonic)
    done
    if [ "$now" != "$first" ] && [ "$now" != 0 ]; then
        pass "watchdog: WatchdogSec=$(prop WatchdogUSec), a ping recorded after $(since "$t0") s of waiting"
    else
        fail "watchdog: WatchdogTimestamp did not move in 12 s (WatchdogSec=$(prop WatchdogUSec))"
    fi
}

# A metric from /metrics (fetched from inside), summed over its labels; "" if absent.
metric() {
    in_container /opt/cached/bin/python -c '
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
name = sys.argv[2]
vals = [float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.split("{")[0].split(" ")[0] == name]
print(int(sum(vals)) if vals else "")
' "$metrics_url" "$1" 2>/dev/null || true
}

# The unit as shipped: the socket srw-rw---- cached:cached (the daemon's chmod, not the
# umask) in a 0750 /run/cached, the daemon's umask 0077; the hot tier /var/cache/cached a
# 0750 directory of 0640 shards, nothing in it open to others. alice, admitted the
# documented way (usermod -aG cached), reads every shard from the files themselves, with
# a reader that requires local reads, and the daemon counts those bytes; bob, outside the
# group, can neither connect nor open a shard file.
check_access() {
    local sock dir umask
    sock=$(in_container stat -c '%A %U:%G' /run/cached/cached.sock 2>&1 || true)
    dir=$(in_container stat -c '%a %U:%G' /run/cached 2>&1 || true)
    umask=$(in_container awk '/^Umask:/ { print $2 }' "/proc/$(prop MainPID)/status" 2>&1 || true)
    if [ "$sock" = "srw-rw---- cached:cached" ] && [ "$dir" = "750 cached:cached" ] && [ "$umask" = 0077 ]; then
        pass "socket: /run/cached/cached.sock $sock, /run/cached $dir; daemon umask $umask"
    else
        fail "socket: /run/cached/cached.sock '$sock', /run/cached '$dir', umask '$umask'; want srw-rw---- cached:cached, 750 cached:cached, 0077"
    fi
    in_container useradd --no-create-home --shell /usr/sbin/nologin alice
    in_container usermod -aG cached alice   # the documented admission
    local out rc=0 gets local_bytes fallback_bytes
    out=$(read_as alice --local on 2>&1) || rc=$?
    gets=$(shard_gets)
    local_bytes=$(metric cached_local_read_bytes_total)
    fallback_bytes=$(metric cached_local_fallback_bytes_total)
    # The shards are the old unit's: read with no fetch.
    if [ "$rc" -eq 0 ] && grep -q "from the hot tier's files" <<<"$out" && [ "$gets" = "$old_gets" ] &&
        [ "${local_bytes:-0}" -gt 0 ] && [ "$fallback_bytes" = 0 ]; then
        pass "read as alice (usermod -aG cached), local reads required: $out; shard GETs at S3 $old_gets -> $gets (the old unit's shards);" \
            "cached_local_read_bytes_total $local_bytes, cached_local_fallback_bytes_total $fallback_bytes"
    else
        fail "read as alice (usermod -aG cached), local reads required: exit $rc: $out;" \
            "cached_local_read_bytes_total '$local_bytes', cached_local_fallback_bytes_total '$fallback_bytes'"
        diagnose
    fi
    local hot=/var/cache/cached kind modes open
    kind=$(in_container stat -c '%F %a %U:%G' "$hot" 2>&1 || true)
    modes=$(in_container sh -c "stat -c '%a %U:%G' $hot/*.tar" 2>&1 | sort -u | paste -sd, - || true)
    open=$(in_container find "$hot" -perm /o=rwx 2>&1 | paste -sd, - || true)
    if [ "$kind" = "directory 750 cached:cached" ] && [ "$modes" = "640 cached:cached" ] && [ -z "$open" ]; then
        pass "hot tier: $hot $kind, $(in_container sh -c "ls $hot/*.tar | wc -l") shards $modes, nothing open to others"
    else
        fail "hot tier: $hot '$kind', shards '$modes', open to others: '$open'; want directory 750 cached:cached, 640 cached:cached, none"
    fi
    check_refused bob
}

# USER, outside group cached, is refused: connecting (a read error that says why, not a
# timeout or a daemon that went away) and opening a shard file.
check_refused() {
    local user=$1 out rc=0 shard
    out=$(read_as "$user" 2>&1) || rc=$?
    if [ "$rc" -eq 2 ] && grep -qi 'permission denied' <<<"$out"; then
        pass "refused $user, not in group cached, the socket: $out"
    else
        fail "refused $user, not in group cached, the socket: exit $rc, want a \"permission denied\" read error: $out"
    fi
    rc=0
    shard=$(in_container sh -c "ls /var/cache/cached/*.tar | head -n 1")  # named by root: bob cannot list
    out=$(in_container runuser -u "$user" -- cat "$shard" 2>&1 >/dev/null) || rc=$?
    if [ "$rc" -ne 0 ] && grep -qi 'permission denied' <<<"$out"; then
        pass "refused $user, not in group cached, the shard files: $out"
    else
        fail "$user, not in group cached, could read the shard files (exit $rc): $out"
    fi
}

# SIGKILL is a failure, so Restart=on-failure starts a new instance after RestartSec=2s; it
# finds the shards of the first in the hot tier and fetches nothing.
check_sigkill() {
    local old_pid gets_before restarts_before
    old_pid=$(prop MainPID)
    restarts_before=$(prop NRestarts)
    gets_before=$(shard_gets)
    local t0=$EPOCHREALTIME new_pid="" active=""
    in_container systemctl kill -s SIGKILL cached
    for _ in $(seq 300); do   # 30 s
        new_pid=$(prop MainPID)
        active=$(in_container systemctl is-active cached || true)
        if [ "$active" = active ] && [ "$new_pid" != 0 ] && [ "$new_pid" != "$old_pid" ]; then
            break
        fi
        sleep 0.1
    done
    local took restarts
    took=$(since "$t0")
    restarts=$(prop NRestarts)
    if [ "$active" != active ] || [ "$new_pid" = "$old_pid" ]; then
        fail "SIGKILL: no restart within 30 s (unit '$active', MainPID $old_pid -> $new_pid)"
        diagnose
        return
    fi
    local out rc=0 status fetched shards gets
    out=$(read_as alice --local on 2>&1) || rc=$?
    status=$(in_container cached status --json 2>&1 || true)
    fetched=$("$py" -c 'import json, sys; print(int(json.loads(sys.argv[1])["counters"]["fetched_bytes"]))' "$status" 2>/dev/null || echo "?")
    shards=$("$py" -c 'import json, sys; print(json.loads(sys.argv[1])["hot"]["shards"])' "$status" 2>/dev/null || echo "?")
    gets=$(shard_gets)
    local figures="active again after ${took} s (MainPID $old_pid -> $new_pid, NRestarts $restarts_before -> $restarts); read: $out; new instance: $shards shards in the hot tier, fetched_bytes=$fetched; shard GETs at S3 $gets_before -> $gets"
    if [ "$rc" -eq 0 ] && [ "$fetched" = 0 ] && [ "$gets" = "$gets_before" ]; then
        pass "SIGKILL restart, hot tier warm: $figures"
    else
        fail "SIGKILL restart, hot tier warm: $figures"
    fi
}

check_stop() {
    local t0=$EPOCHREALTIME rc=0
    T=45 in_container systemctl stop cached || rc=$?
    local took result code status
    took=$(since "$t0")
    result=$(prop Result)
    code=$(prop ExecMainCode)
    status=$(prop ExecMainStatus)
    # ExecMainCode 1 = CLD_EXITED: the daemon exited on its own, not killed by a signal.
    if [ "$rc" -eq 0 ] && [ "$result" = success ] && [ "$code" = 1 ] && [ "$status" = 0 ] &&
        awk -v t="$took" 'BEGIN { exit !(t < 30) }'; then
        pass "stop: ${took} s (TimeoutStopSec=$(prop TimeoutStopUSec)), Result=$result, exit status $status"
    else
        fail "stop: ${took} s, systemctl exit $rc, Result=$result, ExecMainCode=$code, ExecMainStatus=$status"
        diagnose
    fi
}

# The shipped example drop-in for any local user (deploy/systemd/any-local-user.conf,
# installed the way its comment says): the socket srw-rw-rw- in a 0755 /run/cached, so bob
# connects and reads (through the socket: the hot tier stays the group's, his reader
# falls back by itself), and alice still reads from the files.
check_any_user_dropin() {
    in_container install -D -m 0644 /src/deploy/systemd/any-local-user.conf \
        /etc/systemd/system/cached.service.d/any-local-user.conf
    in_container systemctl daemon-reload
    local rc=0
    T=90 in_container systemctl restart cached || rc=$?
    if [ "$rc" -ne 0 ]; then
        fail "any-local-user drop-in: the unit did not start with it (systemctl exit $rc)"
        diagnose
        return
    fi
    local sock dir
    sock=$(in_container stat -c '%A %U:%G' /run/cached/cached.sock 2>&1 || true)
    dir=$(in_container stat -c '%a %U:%G' /run/cached 2>&1 || true)
    if [ "$sock" = "srw-rw-rw- cached:cached" ] && [ "$dir" = "755 cached:cached" ]; then
        pass "socket (any-local-user drop-in): /run/cached/cached.sock $sock, /run/cached $dir"
    else
        fail "socket (any-local-user drop-in): '$sock', '$dir'; want srw-rw-rw- cached:cached, 755 cached:cached"
    fi
    local out rc_a=0 rc_b=0 gets_before
    gets_before=$(shard_gets)
    out=$(read_as bob 2>&1) || rc_b=$?
    if [ "$rc_b" -eq 0 ] && grep -q "through the socket" <<<"$out" && [ "$(shard_gets)" = "$gets_before" ]; then
        pass "read (any-local-user drop-in) as bob, not in the group: $out; nothing fetched again"
    else
        fail "read (any-local-user drop-in) as bob, not in the group: exit $rc_b: $out"
        diagnose
    fi
    out=$(read_as alice --local on 2>&1) || rc_a=$?
    if [ "$rc_a" -eq 0 ] && grep -q "from the hot tier's files" <<<"$out"; then
        pass "read (any-local-user drop-in) as alice, in the group, local reads required: $out"
    else
        fail "read (any-local-user drop-in) as alice, local reads required: exit $rc_a: $out"
    fi
    local shard
    rc=0
    shard=$(in_container sh -c "ls /var/cache/cached/*.tar | head -n 1")
    out=$(in_container runuser -u bob -- cat "$shard" 2>&1 >/dev/null) || rc=$?
    if [ "$rc" -ne 0 ] && grep -qi 'permission denied' <<<"$out"; then
        pass "refused (any-local-user drop-in) bob the shard files: $out"
    else
        fail "bob could read the shard files under the any-local-user drop-in (exit $rc): $out"
    fi
    T=45 in_container systemctl stop cached || true
}

# The whole run's journal of the unit: the one SIGKILL above is the only crash; nothing
# died of a signal it did not get from us (SIGSYS: SystemCallFilter=, SIGSEGV:
# MemoryDenyWriteExecute=, SIGABRT: the watchdog or libzmq), no traceback, no error line.
check_journal() {
    local journal bad kills
    journal=$(in_container journalctl -u cached -b --no-pager -o cat)
    [ -n "${DEPLOY_CHECK_JOURNAL:-}" ] && indent <<<"$journal"
    kills=$(grep -c 'status=9/KILL' <<<"$journal" || true)
    bad=$(grep -E 'Traceback|status=[0-9]+/(SYS|SEGV|ABRT|BUS|ILL)|code=dumped|[Ww]atchdog timeout| ERROR | CRITICAL ' <<<"$journal" || true)
    if [ -z "$bad" ] && [ "$kills" -le 1 ]; then
        pass "journal: $(wc -l <<<"$journal") lines of the unit, no traceback, no error, no crash besides our SIGKILL"
    else
        fail "journal: unexpected lines ($kills SIGKILLs):"
        head -n 20 <<<"$bad" | indent
    fi
}

main() {
    skip_unless_possible
    trap cleanup EXIT
    # An unexpected error (set -e) names itself before the cleanup.
    trap 'fail "unexpected: \"$BASH_COMMAND\" exited $? (line $LINENO)"' ERR
    trap 'exit 130' INT TERM
    read_apt_source
    ensure_root
    ensure_wheels
    work=$(mktemp -d /tmp/cached-deploy-check.XXXXXX)
    mkdir -m 0755 "$work/share"   # /check in the container, read by alice and bob
    cp "$repo/deploy/check/systemd_check.py" "$work/share/"
    start_s3
    cp "$work/manifest.json" "$work/share/"
    chmod 0644 "$work/share/"*
    boot
    check_install
    check_old_unit
    if check_start; then
        check_watchdog
        check_access
        check_sigkill
        check_stop
        check_any_user_dropin
        check_journal
    fi
    log "systemd-analyze security (inside): $(in_container systemd-analyze security --no-pager cached 2>&1 | tail -n 1 | sed 's/^→ *//')"
    finish
}

main "$@"
