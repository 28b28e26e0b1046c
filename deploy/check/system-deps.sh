#!/usr/bin/env bash
# Debian packages that the deployment checks and the tests use, installed when missing:
#   docker-compose     `docker-compose config` (v1 validates a compose file offline)
#   debootstrap        the Debian root that `make deploy-check` boots
#   systemd-container  systemd-nspawn, which boots it
#   chromium           the headless browser that tests the dashboard (tests/test_dashboard.py)
#   prometheus         promtool, which checks the alert rules (deploy/prometheus/)
#   ceph-mon ceph-osd radosgw ceph-common
#                      Ceph's RADOS Gateway, the real S3 engine the S3-facing tests run on
#                      beside moto (tests/rgw.py; without it they run on moto alone)
# Only as root with apt-get; elsewhere it says what is missing, and each check that needs
# a missing tool says in one line that it skips.
set -euo pipefail

want=()
command -v docker-compose >/dev/null || want+=(docker-compose)
command -v debootstrap >/dev/null || want+=(debootstrap)
command -v systemd-nspawn >/dev/null || want+=(systemd-container)
command -v chromium >/dev/null || want+=(chromium)
command -v promtool >/dev/null || want+=(prometheus)
command -v ceph-mon >/dev/null || want+=(ceph-mon)
command -v ceph-osd >/dev/null || want+=(ceph-osd)
command -v radosgw >/dev/null || want+=(radosgw)
command -v monmaptool >/dev/null || want+=(ceph-common)
[ ${#want[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "system-deps: missing ${want[*]} (install them with your package manager; not root or no apt-get here)"
    exit 0
fi
echo "system-deps: installing ${want[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
