#!/usr/bin/env bash
# Set up and run the main job: torch and delta-attn with the `bench` extra (scripts/_setup.sh), the environment
# report, then the linear-vs-quadratic crossover benchmark (on a machine with no GPU it says so and runs the
# tiny CPU mode). Extra arguments go to `delta-attn bench crossover` (e.g. --quick, --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_setup.sh
setup bench
python -m delta_attn.cli env
exec python -m delta_attn.cli bench crossover "$@"
