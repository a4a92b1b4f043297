#!/usr/bin/env bash
# Install Ceph's RADOS Gateway (with the one mon and one osd it needs) from Debian's archive, for the
# tests that run kvgw's S3 tier against a real S3 server and for `kvgw bench s3` (gateway/bench/rgw.py:
# started by the test fixtures, the bench, or by hand with `python -m tests.rgw start DIR`). Installs
# only: starting a cluster is the launcher's job.
#
# Idempotent: does nothing when every command is already there; otherwise `apt-get update` once, then
# the packages (Ceph 16.2 Pacific here: 59 packages, ~67 MB download, ~263 MB installed, ~25 s).
set -euo pipefail

needed=(radosgw ceph-mon ceph-osd ceph-common)
commands=(radosgw radosgw-admin ceph-mon ceph-osd ceph monmaptool)

missing=0
for cmd in "${commands[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || missing=1
done
if [ "$missing" = 0 ]; then
    echo "ceph rgw: already installed ($(ceph --version 2>/dev/null | cut -d' ' -f1-3))"
    exit 0
fi

SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${needed[@]}"

for cmd in "${commands[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || { echo "ceph rgw: $cmd missing after install" >&2; exit 1; }
done
echo "ceph rgw: installed ($(ceph --version | cut -d' ' -f1-3))"
