#!/bin/sh
# Install the cached daemon, without torch, into the environment of a Python interpreter.
#   deploy/install-daemon.sh /opt/cached/bin/python [SOURCE_DIR]
# Used by the systemd install (deploy/systemd/install.sh) and the Dockerfile.
#
# cached-daemon depends on cached-client for the wire protocol; cached-client's torch is an
# extra (`cached-client[torch]`) that the daemon does not ask for, so a plain install of the
# two brings no torch and `pip check` passes. Both come from SOURCE_DIR (cached-client is
# not on an index); their other dependencies from the index, or from PIP_FIND_LINKS with
# PIP_NO_INDEX (deploy/check/systemd.sh).
set -eu
py=${1:?usage: install-daemon.sh PYTHON [SOURCE_DIR]}
src=${2:-$(dirname "$0")/..}
"$py" -m pip install --no-cache-dir --disable-pip-version-check -q "$src/client" "$src"
"$py" -m pip check --disable-pip-version-check >/dev/null || {
    "$py" -m pip check --disable-pip-version-check >&2
    echo "install-daemon.sh: pip check failed (above)" >&2
    exit 1
}
