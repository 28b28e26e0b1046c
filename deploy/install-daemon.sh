#!/bin/sh
# Install the cached daemon, without torch, into the environment of a Python interpreter.
#   deploy/install-daemon.sh /opt/cached/bin/python [SOURCE_DIR]
# Used by the systemd install (deploy/systemd/install.sh) and the Dockerfile.
#
# Why not `pip install ./client .`: cached-daemon depends on cached-client (it shares its
# wire protocol module), and cached-client depends on torch, which the daemon never
# imports and which would add gigabytes. pip's resolver follows the dependencies of an
# already-installed package too, so both packages go in with --no-deps and their real
# dependencies are installed explicitly, read from the two pyproject.toml files (minus
# torch and cached-client) so that this script cannot drift from them.
# `pip check` then reports "cached-client requires torch, which is not installed": expected.
set -eu
py=${1:?usage: install-daemon.sh PYTHON [SOURCE_DIR]}
src=${2:-$(dirname "$0")/..}
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$py" - "$src" >"$reqs" <<'PY'
import sys, tomllib
src = sys.argv[1]
for project, skip in (("client", "torch"), (".", "cached-client")):
    with open(f"{src}/{project}/pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    print("\n".join(d for d in deps if not d.replace(" ", "").startswith(skip)))
PY
"$py" -m pip install --no-cache-dir --disable-pip-version-check -q -r "$reqs"
"$py" -m pip install --no-cache-dir --disable-pip-version-check -q --no-deps "$src/client" "$src"
