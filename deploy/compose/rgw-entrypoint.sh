#!/bin/bash
# The entrypoint of deploy/compose/rgw.Dockerfile: a one-node Ceph cluster (one monitor,
# one OSD on MemStore, radosgw) inside the container, serving S3 on :9000 with an S3 user
# whose keys are $MINIO_ROOT_USER / $MINIO_ROOT_PASSWORD (the `minio` service's, which
# docker-compose.yml gives the daemon and dataset-init too; minioadmin/minioadmin if
# unset). The same cluster as tests/rgw.py, whose comments explain each setting: auth
# none, msgr2 in crc mode (else radosgw hangs 300 s), pools of one replica, no mgr.
# Ready (the healthcheck's /run/rgw/ready) once the S3 user exists. On SIGTERM it stops
# radosgw first, then the OSD, then the monitor: radosgw stopped after them hangs.
set -euo pipefail

dir=/var/lib/rgw
port=9000
access_key=${MINIO_ROOT_USER:-minioadmin}
secret_key=${MINIO_ROOT_PASSWORD:-minioadmin}
conf=$dir/ceph.conf
rm -rf "$dir" /run/rgw
mkdir -p "$dir/run" "$dir/log" "$dir/mon.a" "$dir/osd.0" /run/rgw
fsid=$(cat /proc/sys/kernel/random/uuid)

cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:3300]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
ms client mode = crc
ms cluster mode = crc
ms service mode = crc
run dir = $dir/run
admin socket = $dir/run/\$name.asok
pid file = $dir/run/\$name.pid
log file = $dir/log/\$name.log
log to stderr = false
err to stderr = false
mon cluster log file = $dir/log/cluster.log
keyring = $dir/keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
paxos propose interval = 0.1
mon osd down out interval = 0
mon warn on no mgr = false
osd objectstore = memstore
memstore device bytes = 1073741824
osd data = $dir/\$name
mon data = $dir/\$name
osd fast shutdown notify mon = false

[client.rgw]
rgw frontends = beast endpoint=0.0.0.0:$port
rgw thread pool size = 64
rgw gc obj min wait = 5
rgw gc processor period = 10
rgw gc processor max time = 10
rgw enable usage log = false
EOF

say() { printf 'rgw: %s\n' "$*"; }
# The last lines of a daemon's log, on the container's output (docker logs).
tail_log() { tail -n 15 "$dir/log/$1.log" "$dir/log/$1.stderr" 2>/dev/null | sed 's/^/rgw:   | /'; }

pids=()
names=()
spawn() {
    local name=$1
    shift
    "$@" -f -c "$conf" </dev/null >/dev/null 2>"$dir/log/$name.stderr" &
    pids+=($!)
    names+=("$name")
}

stopping=0
stop_all() {
    stopping=1
    local i
    # radosgw first, then the OSD, then the monitor (the reverse of the start order).
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        kill -TERM "${pids[i]}" 2>/dev/null || continue
        for _ in $(seq 100); do kill -0 "${pids[i]}" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "${pids[i]}" 2>/dev/null || true
        wait "${pids[i]}" 2>/dev/null || true
    done
}
trap 'say "stopping (radosgw, then the OSD, then the monitor)"; stop_all; exit 0' TERM INT

t0=$SECONDS
monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:3300]" "$dir/monmap" -c "$conf" >/dev/null
ceph-mon --mkfs -i a --monmap "$dir/monmap" -c "$conf"
spawn mon.a ceph-mon -i a
osd_uuid=$(cat /proc/sys/kernel/random/uuid)
# The first command also waits for the monitor's quorum of one.
osd_id=$(ceph --connect-timeout 20 -c "$conf" osd create "$osd_uuid")
[ "$osd_id" = 0 ] || { say "expected OSD id 0, the monitor gave '$osd_id'"; tail_log mon.a; exit 1; }
ceph-osd -i 0 --mkfs --osd-uuid "$osd_uuid" -c "$conf"
spawn osd.0 ceph-osd -i 0
spawn client.rgw radosgw -n client.rgw

# Serving: any HTTP answer (an anonymous ListBuckets) on the S3 port.
served=0

# A daemon of the cluster that exited ($1: when, for the message): the others are stopped
# and the container exits 1.
exit_if_one_died() {
    for i in "${!pids[@]}"; do
        if ! kill -0 "${pids[i]}" 2>/dev/null; then
            say "${names[i]} exited$1"
            tail_log "${names[i]}"
            stop_all
            exit 1
        fi
    done
}
for _ in $(seq 600); do
    if python3 -c "import urllib.request, urllib.error, sys
try:
    urllib.request.urlopen('http://127.0.0.1:$port/', timeout=2)
except urllib.error.HTTPError:
    pass
except OSError:
    sys.exit(1)" 2>/dev/null; then
        served=1
        break
    fi
    exit_if_one_died " during the start"
    sleep 0.1
done
if [ "$served" -ne 1 ]; then
    say "radosgw not serving on :$port after 60 s"
    tail_log client.rgw
    stop_all
    exit 1
fi
radosgw-admin -n client.rgw -c "$conf" user create --uid compose \
    --display-name "docker-compose stack" --access-key "$access_key" \
    --secret "$secret_key" >/dev/null
touch /run/rgw/ready
say "ready in $((SECONDS - t0)) s: S3 on :$port (path-style), access key $access_key"

# Until a signal (the trap) or until a daemon exits (then the others stop and the
# container exits 1, so that `restart` policies and `docker compose ps` see it).
while :; do
    wait -n || true
    [ "$stopping" -eq 1 ] && exit 0
    exit_if_one_died ""
done
