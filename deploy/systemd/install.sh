#!/bin/sh
# Install cached as a systemd service (as root), the steps of docs/operations.md,
# "Running as a systemd service":
#   1. a venv at /opt/cached made with the system python3 (>= 3.11; PYTHON=... to choose),
#      the daemon installed into it without torch (deploy/install-daemon.sh);
#   2. /usr/local/bin/cached -> /opt/cached/bin/cached (the unit's ExecStart);
#   3. the system user and group `cached`: deploy/systemd/cached.sysusers.conf to
#      /usr/local/lib/sysusers.d/cached.conf, then systemd-sysusers (an existing
#      `cached` is kept);
#   4. /etc/cached/config.toml from config.example.toml, only if absent (0644: the
#      unprivileged service user reads it);
#   5. /etc/cached/env, empty, root:root 0600, only if absent (S3 credentials; systemd
#      reads it as root);
#   6. the unit to /etc/systemd/system/cached.service (replaced: local changes belong in
#      a drop-in), `systemctl daemon-reload` when systemd runs, `systemctl enable cached`.
# It does not start the service: edit the config and the credentials first, then
# `systemctl start cached`, and admit the training users: `usermod -aG cached USER`. Running it again upgrades the daemon in place and keeps
# /etc/cached as it is (restart the service to run the new version).
#   deploy/systemd/install.sh
set -eu

src=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-python3}
venv=/opt/cached

if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: run as root" >&2
    exit 1
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "install.sh: $python is missing or older than 3.11 (set PYTHON=python3.11 or newer)" >&2
    exit 1
fi

# pip builds a source directory in place (build/, *.egg-info): build from a copy, so the
# checkout gets no root-owned files and may be read-only.
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
tar -C "$src" --exclude=__pycache__ --exclude=build --exclude='*.egg-info' \
    -cf - pyproject.toml README.md cached client deploy/install-daemon.sh | tar -C "$build" -xf -

# A venv outside /home and /root: the unit sets ProtectHome=yes.
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$build/deploy/install-daemon.sh" "$venv/bin/python" "$build"
ln -sfn "$venv/bin/cached" /usr/local/bin/cached

# The service's user and group; the group admits training users to the socket and the
# hot tier. systemd-sysusers finds cached.conf in its search path (/etc/sysusers.d first,
# so a local copy there, with pinned ids, wins).
install -D -m 0644 "$src/deploy/systemd/cached.sysusers.conf" /usr/local/lib/sysusers.d/cached.conf
systemd-sysusers cached.conf

install -d -m 0755 /etc/cached
[ -e /etc/cached/config.toml ] || install -m 0644 "$src/config.example.toml" /etc/cached/config.toml
[ -e /etc/cached/env ] || install -m 0600 /dev/null /etc/cached/env

install -m 0644 "$src/deploy/systemd/cached.service" /etc/systemd/system/cached.service
# Without a running systemd (a chroot, an image build) enable still creates the links.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi
systemctl enable cached
echo "installed; now edit /etc/cached/config.toml and /etc/cached/env, then: systemctl start cached"
echo "admit each training user (a new login follows): usermod -aG cached USER"
