#!/usr/bin/env bash
# Run the whole test suite (real local Slurm cluster included; needs root and scripts/setup.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
# Two workers (pytest-xdist), each with a real cluster of its own (tests/conftest.py says why
# two fit on 2 cores).
.venv/bin/python -m pytest -n 2 "$@"
rc=$?
# 5 = pytest collected no tests: that is a failure of the suite, not a pass
if [ $rc -eq 5 ]; then echo "HPCT: no tests were collected" >&2; exit 1; fi
exit $rc
