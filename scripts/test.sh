#!/usr/bin/env bash
# Set up and run the CPU test suite: torch (kept when one imports; else the CPU build on a machine without an
# NVIDIA GPU, the CUDA build with one: scripts/_setup.sh), delta-attn with the `test` extra, ruff on src/, then pytest on
# 2 workers. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_setup.sh
setup test
python -m ruff check src        # the linter ([tool.ruff] in pyproject.toml), before the tests
exec python -m pytest -q -n 2 "$@"
