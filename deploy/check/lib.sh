# Shared by deploy/check/systemd.sh and deploy/check/compose.sh (sourced; each defines log()
# and sets cache, packages and, before ensure_root, suite and mirror): the output helpers,
# this machine's Debian suite and mirror, and the debootstrap root both boot or import.
# shellcheck shell=bash disable=SC2154  # cache, packages: set by the script that sources this

pass() { printf 'PASS  %s\n' "$*"; }
fail() { printf 'FAIL  %s\n' "$*"; failures=$((failures + 1)); }
indent() { sed 's/^/      | /'; }
# Seconds since $1 (an $EPOCHREALTIME), to 0.1 s.
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
# The last line: every check passed since $started, or how many failed (exit status 1).
finish() {
    if [ "$failures" -eq 0 ]; then
        log "all checks passed in $(since "$started") s"
    else
        log "$failures check(s) FAILED, $(since "$started") s"
        exit 1
    fi
}

# The suite and mirror of this machine's own apt sources (deb822 first, then the one-line
# format): the first "deb" entry's URI and its base suite (not -updates or -security).
# Read at run time, so that no mirror is written into the repository.
read_apt_source() {
    local found=""
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -e "$f" ] || continue
        found=$(awk '
            function flush(  i) {
                if (!done && types ~ /(^|[ \t])deb([ \t]|$)/ && enabled != "no" && uri != "")
                    for (i = 1; i <= ns; i++)
                        if (s[i] !~ /-/) { print uri, s[i]; done = 1; break }
                types = ""; uri = ""; enabled = ""; ns = 0
            }
            /^[ \t]*$/ { flush(); next }
            /^[ \t]*#/ { next }
            tolower($1) == "types:"   { types = $0 }
            tolower($1) == "uris:"    { uri = $2 }
            tolower($1) == "suites:"  { ns = split(substr($0, index($0, ":") + 1), s, " ") }
            tolower($1) == "enabled:" { enabled = tolower($2) }
            END { flush() }
        ' "$f" | head -n1)
        [ -n "$found" ] && break
    done
    if [ -z "$found" ] && [ -e /etc/apt/sources.list ]; then
        found=$(awk '$1 == "deb" {
            i = 2
            if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }   # [ options ]
            if ($(i + 1) !~ /-/) { print $i, $(i + 1); exit }
        }' /etc/apt/sources.list)
    fi
    if [ -z "$found" ]; then
        fail "no Debian suite/mirror found in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list"
        exit 1
    fi
    read -r mirror suite <<<"$found"
}

# Remove a directory that may hold mounts (an interrupted debootstrap, the engine's network
# namespaces): unmount what is below it first, and never cross into another file system.
remove_tree() {
    local dir=$1
    [ -d "$dir" ] || return 0
    findmnt -rno TARGET | awk -v d="$dir/" 'index($0, d) == 1' | sort -r | xargs -r umount -l
    rm -rf --one-file-system "$dir"
}

# A debootstrap that ensure_root started and an interrupt cut short: its whole session
# (dpkg in the chroot too) ended, TERM and then KILL, before its directory is removed.
stop_debootstrap() {
    [ -n "${debootstrap_pid:-}" ] || return 0
    kill -TERM -- "-$debootstrap_pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 -- "-$debootstrap_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$debootstrap_pid" 2>/dev/null
    wait "$debootstrap_pid" 2>/dev/null
    debootstrap_pid=""
}

# --- the Debian root, built once ----------------------------------------------------------
# Built into a temporary directory and renamed when complete, so an interrupted build is
# never reused; its leftovers (.build-* older than two hours) are removed on a later run.
ensure_root() {
    local key
    key=$(printf '%s\n' "$suite" "${packages[@]}" | sha256sum | cut -c1-12)
    root=$cache/root-$suite-$key
    mkdir -p "$cache"
    find "$cache" -maxdepth 1 -name '.build-*' -mmin +120 -print0 |
        while IFS= read -r -d '' old; do remove_tree "$old"; done
    if [ -d "$root" ]; then
        log "root: $root (cached)"
        return
    fi
    local t0=$EPOCHREALTIME
    log "root: debootstrap $suite from $mirror into $root (once; a few minutes)"
    building=$(mktemp -d "$cache/.build-root-XXXXXX")
    # In its own session, waited for with `wait`: an interrupt runs the cleanup at once,
    # which ends the whole build (dpkg in the chroot too) before removing its directory.
    setsid debootstrap --variant=minbase --include="$(IFS=,; echo "${packages[*]}")" \
        "$suite" "$building" "$mirror" >"$building.log" 2>&1 9>&- &
    debootstrap_pid=$!
    if ! wait "$debootstrap_pid"; then
        tail -n 20 "$building.log" | indent
        fail "debootstrap $suite failed (log above)"
        exit 1
    fi
    debootstrap_pid=""
    chroot "$building" apt-get clean
    chmod 0755 "$building"   # mktemp made it 0700: it becomes the container's /
    mv -T "$building" "$root" 2>/dev/null || remove_tree "$building"   # a concurrent run won
    rm -f "$building.log"
    building=""
    log "root: built in $(since "$t0") s ($(du -sh "$root" | cut -f1))"
}
