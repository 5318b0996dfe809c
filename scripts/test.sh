#!/usr/bin/env bash
# Set up, lint src/ and run the CPU test suite. Keeps an installed torch (GPU machines); on a machine without
# torch it installs the CPU build first so that pip never pulls CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test]'
python -m ruff check src        # the linter ([tool.ruff] in pyproject.toml), before the tests
exec python -m pytest -q -n 2 "$@"
