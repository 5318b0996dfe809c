#!/usr/bin/env bash
# On a GPU machine (no install needed: runs from the source tree): the environment report, then the
# GPU test suite. Peers travel as wheels in .whl/ when present. Logs go to $OUT (or ./gpu-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:src
else
  export PYTHONPATH=src
fi
python3 -m delta_attn.cli env | tee "$OUT/env.txt"
python3 -m delta_attn.cli env --json > "$OUT/env.json"
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider --tb=short --junitxml="$OUT/gpu-tests.xml" "$@" 2>&1 | tee "$OUT/gpu-tests.log" | grep -v "^DEBUG" | tail -60
