#!/usr/bin/env bash
# Install everything hpct-slurm needs on a Debian 12 machine (as root), then run the demo.
#   Debian's Slurm 22.05 + munge via apt-get, a virtualenv in .venv with torch pinned to the
#   CPU wheel (an unpinned torch pulls a multi-GB CUDA build), and the package itself.
# Usage: bash scripts/setup.sh [--no-demo]
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "HPCT: setup needs root (apt-get, network namespaces, slurmd)" >&2
  exit 2
fi

# libc6-dev: gcc only recommends it, and --no-install-recommends leaves it out on a minimal image
# (the SPANK plugin then fails on errno.h); python3-venv: ensurepip lives there on Debian;
# nftables: the Prolog's fence (HPCT_FENCE=nft) and its tests.
PKGS=(slurmctld slurmd slurm-client munge libslurm-dev gcc libc6-dev make python3-venv iproute2
      util-linux procps nftables)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install -q "torch==${HPCT_TORCH_VERSION:-2.13.0}"
.venv/bin/pip install -q -e '.[test,peers]'  # peers: torchft and NVRx, for `bench peers` and its test

if [ "${1:-}" != "--no-demo" ]; then
  .venv/bin/hpct-slurm demo
fi
