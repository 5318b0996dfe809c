#!/usr/bin/env bash
# Set up and run the main job: the environment report, then the linear-vs-quadratic crossover
# benchmark (on a machine with no GPU it says so and runs the tiny CPU mode). Extra arguments go
# to `delta-attn bench crossover` (e.g. --quick, --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[bench]'
delta-attn env
delta-attn bench crossover "$@"
