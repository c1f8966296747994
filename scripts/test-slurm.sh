#!/usr/bin/env bash
# Run the Slurm-facing tests against one Slurm release and end with one line
#   slurm <version>: N passed, M failed
# (M counts failures and errors).
#
#   scripts/test-slurm.sh 22.05 [pytest args...]   # this machine's Slurm (Debian 12)
#   scripts/test-slurm.sh 24.11 [pytest args...]   # Debian 13 (trixie) in a chroot
#   scripts/test-slurm.sh 26.05 [pytest args...]   # Debian unstable (sid) in a chroot
#
# Needs root and scripts/setup.sh (the venv). For 24.11 and 26.05 the chroot is
# /srv/hpct-slurm-<codename> (HPCT_SLURM_CHROOT=DIR elsewhere); it is made with debootstrap from
# Debian's archive when missing (about a minute) and its Slurm packages installed into it.
# The tests run inside it with *this machine's* venv (Python 3.11, the CPU torch): the venv and
# its base interpreter are bind-mounted at their own paths, so nothing is downloaded for Python
# (PyPI's torch for the chroot's Python 3.13/3.14 is the 4.9 GB CUDA build). Everything is
# mounted in a private mount namespace whose root is the chroot (pivot_root), so the node
# namespaces the local cluster makes (`nsenter -m`) land in the chroot too, and every mount
# disappears with the namespace's last process: nothing is left mounted on this machine.
# HPCT_TEST_PYTHON=PATH: the venv's python (default .venv/bin/python).
# HPCT_SLURM_CHROOT=DIR: the chroot (default /srv/hpct-slurm-<codename>).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

usage() { echo "usage: scripts/test-slurm.sh 22.05|24.11|26.05 [pytest args...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
release=$1; shift
case "$release" in
  22.05) codename=bookworm ;;
  24.11) codename=trixie ;;
  26.05) codename=sid ;;
  *) usage ;;
esac

# The Slurm-facing tests: the client (recorded output of every release, and live), the hooks,
# the SPANK plugin, the spare pool, the node lifecycle, the local cluster and the controller's
# recovery on it, the Prolog's fence, fail-slow's drains. docs/admin.md lists what ran on which
# release.
FILES=(
  tests/test_slurm_recorded.py tests/test_slurm_door.py tests/test_slurm_client_cluster.py
  tests/test_slurmenv.py tests/test_hostlist.py
  tests/test_hooks.py tests/test_hooks_never_fail.py
  tests/test_spank_cluster.py
  tests/test_spares.py tests/test_spares_cluster.py
  tests/test_lifecycle_fast.py tests/test_lifecycle_cluster.py
  tests/test_localcluster.py tests/test_recovery_cluster.py tests/test_fault_matrix.py
  tests/test_fence_cluster.py tests/test_failslow_cluster.py
)
# HPCT_SLURM_TESTS="tests/a.py tests/b.py::test_x": run those instead
[ -z "${HPCT_SLURM_TESTS:-}" ] || read -r -a FILES <<<"$HPCT_SLURM_TESTS"

PY=${HPCT_TEST_PYTHON:-$REPO/.venv/bin/python}
if [ ! -x "$PY" ]; then
  echo "HPCT: no python at $PY: run scripts/setup.sh first (or set HPCT_TEST_PYTHON)" >&2
  exit 2
fi
if [ "$(id -u)" != 0 ]; then
  echo "HPCT: the Slurm tests need root (slurmd, network namespaces, chroot)" >&2
  exit 2
fi

report=$(mktemp -d /tmp/hpct-test-slurm.XXXXXX)
trap 'rm -rf "$report"' EXIT

# the installed Slurm's version (scontrol --version needs a reachable config from 23.x on)
slurm_version() {
  dpkg-query -W -f '${Version}' slurm-client 2>/dev/null | sed 's/^[0-9]*://; s/-[^-]*$//'
}
export -f slurm_version

# summary JUNIT_XML VERSION: the one line
summary() {
  "$PY" - "$1" "$2" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as e:
    print(f"slurm {sys.argv[2]}: 0 passed, 1 failed (no test report: {e})")
    sys.exit()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n = lambda k: sum(int(s.get(k, 0)) for s in suites)
bad = n("failures") + n("errors")
print(f"slurm {sys.argv[2]}: {n('tests') - bad - n('skipped')} passed, {bad} failed"
      + (f", {n('skipped')} skipped" if n("skipped") else ""))
EOF
}

if [ "$release" = 22.05 ]; then
  version=$(slurm_version)
  case "$version" in
    22.05.*) ;;
    *) echo "HPCT: this machine's Slurm is '${version:-none}', not 22.05" >&2; exit 2 ;;
  esac
  start=$(date +%s)
  "$PY" -m pytest -n 2 -p no:cacheprovider --junitxml="$report/junit.xml" "${FILES[@]}" "$@"
  rc=$?
  echo "HPCT: $(( $(date +%s) - start )) s"
  summary "$report/junit.xml" "$version"
  exit $rc
fi

# ---- a newer release, in a chroot ----------------------------------------------------------
ROOT=${HPCT_SLURM_CHROOT:-/srv/hpct-slurm-$codename}
ARCHIVE=${HPCT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# what the tests need from the chroot: Slurm and munge, the SPANK plugin's toolchain, ip and
# nsenter/unshare for the local cluster, nft for the Prolog's fence; python3 brings the shared
# libraries the host's Python links against (ssl, ffi, sqlite, ...)
PKGS=(slurmctld slurmd slurm-client munge libslurm-dev gcc libc6-dev make iproute2 util-linux
      procps nftables python3)
# sid's Release files are valid for a week; a mirror frozen in time serves expired ones
APT=(apt-get -o Acquire::Check-Valid-Until=false)

if [ ! -x "$ROOT/usr/sbin/slurmctld" ] || ! chroot "$ROOT" dpkg -s "${PKGS[@]}" >/dev/null 2>&1; then
  start=$(date +%s)
  if [ ! -e "$ROOT/etc/debian_version" ]; then
    command -v debootstrap >/dev/null || { apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; } || exit 2
    echo "HPCT: making $ROOT (debootstrap --variant=minbase $codename)"
    debootstrap --variant=minbase "$codename" "$ROOT" "$ARCHIVE" >"$report/debootstrap.log" 2>&1 \
      || { tail -20 "$report/debootstrap.log" >&2; exit 2; }
  fi
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  echo "HPCT: installing ${PKGS[*]} into $ROOT"
  unshare -m --propagation private sh -c 'root=$1; shift
    mount -t proc proc "$root/proc" && mount --bind /dev "$root/dev" && exec chroot "$root" "$@"
    ' sh "$ROOT" sh -c \
    "${APT[*]} update -qq && DEBIAN_FRONTEND=noninteractive ${APT[*]} install -y -qq \
     --no-install-recommends ${PKGS[*]} >/dev/null" || exit 2
  echo "HPCT: chroot ready in $(( $(date +%s) - start )) s"
fi

# The venv and the Python it was made from, at their own paths inside the chroot.
VENV=$(cd "$(dirname "$PY")/.." && pwd)
BASE=$("$PY" -c 'import sys; print(sys.base_prefix)')
REAL=$(readlink -f "$PY")
PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
export REPO ROOT VENV BASE REAL PYVER PY report

inner() {  # runs in the private mount namespace, as root of it
  set -e
  mount --bind "$ROOT" "$ROOT"
  mount -t proc proc "$ROOT/proc"
  mount --rbind /sys "$ROOT/sys"
  mount --bind /dev "$ROOT/dev"
  mount --bind /dev/pts "$ROOT/dev/pts" 2>/dev/null || true
  mount -t tmpfs -o mode=1777 shm "$ROOT/dev/shm"
  mount -t tmpfs -o mode=0755 run "$ROOT/run"
  # the chroot's own /tmp, on disk: a failed run's files stay there to be read afterwards
  # ($ROOT/tmp/pytest-of-root/..., the cluster logs in $ROOT/tmp/hpct-test-cluster-last-log*)
  # the machine's hostname must resolve (slurmctld stalls ~10 s otherwise)
  mount --bind -o ro /etc/hosts "$ROOT/etc/hosts"
  bind() {  # bind SRC [ro]: SRC at its own path inside
    if [ -d "$1" ]; then mkdir -p "$ROOT$1"; else mkdir -p "$(dirname "$ROOT$1")"; touch "$ROOT$1"; fi
    mount --bind "$1" "$ROOT$1"
    [ "${2:-}" != ro ] || mount -o remount,bind,ro "$ROOT$1"
    # every user may pass through its parents, as on this machine: the fence test runs the
    # venv's python as uid 65534, and the chroot's /root is 0700 (a pyenv interpreter lives
    # under /root)
    local d
    d=$(dirname "$1")
    while [ "$d" != / ]; do chmod o+x "$ROOT$d"; d=$(dirname "$d"); done
  }
  bind "$REPO"
  bind "$report"
  bind "$VENV" ro
  if [ "$BASE" = /usr ]; then
    # Debian's own python3.X: its binary and standard library (the chroot has another python3).
    # The venv's bin/python3 links to /usr/bin/python3, the chroot's: in this namespace only,
    # that name is this interpreter.
    bind "$REAL" ro
    bind "/usr/lib/python$PYVER" ro
    mount --bind "$REAL" "$(readlink -f "$ROOT/usr/bin/python3")"
  else
    bind "$BASE" ro
  fi
  cd "$ROOT"
  mkdir -p .hpct-oldroot
  pivot_root . .hpct-oldroot
  umount -l /.hpct-oldroot
  rmdir /.hpct-oldroot 2>/dev/null || true
  cd "$REPO"
  export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  slurm_version >"$report/version"
  "$PY" -m pytest -n 2 -p no:cacheprovider --junitxml="$report/junit.xml" "$@" || rc=$?
  exit ${rc:-0}
}
export -f inner

start=$(date +%s)
unshare -m --propagation private bash -c 'inner "$@"' inner "${FILES[@]}" "$@"
rc=$?
rmdir "$ROOT$report" 2>/dev/null  # the mount point of the report dir
echo "HPCT: $(( $(date +%s) - start )) s"
version=$(cat "$report/version" 2>/dev/null || echo "$release (did not start)")
summary "$report/junit.xml" "$version"
exit $rc
