#!/usr/bin/env bash
# The GPU check (issue 26), for a machine with one GPU, torch preinstalled, and no Slurm or
# network (a typical GPU test machine): the `gpu` test tier, then `hpct-slurm bench gpu`
# (snapshot cost per step, restore against a raw copy, NCCL form/abort/re-form), in under
# 5 minutes. Results go to $OUT (default results/gpu-check): gpu.json, gpu_overlap.png and
# gpu-tests.xml. Wheels the machine lacks (blake3; pytest, matplotlib where missing) travel in
# .whl/ and are installed from there, offline.
# Usage: bash scripts/gpu-check.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hpct-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/hpct-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c 'import torch; print("HPCT gpu-check: torch", torch.__version__, "cuda", torch.version.cuda,
  "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
  "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)' || exit 1
timeout 150 "$PY" -m pytest -q tests/test_gpu.py tests/test_nccl_path.py \
  -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml"
tests_rc=$?
timeout 240 "$PY" -m hpct_slurm.cli bench gpu --out "$OUT" "$@"
bench_rc=$?
echo "HPCT gpu-check: tests exit $tests_rc, bench exit $bench_rc; results in $OUT"
[ $tests_rc -eq 0 ] && [ $bench_rc -eq 0 ]
