"""Localise the GPU fuzz's illegal addresses (experiment script: deleted once measured).
    python benchmarks/kda_debug_bf16.py SEED [repeats]   one fuzz configuration, run `repeats` times"""
import sys

import torch

sys.path.insert(0, "tests")
import kda_props  # noqa: E402

seed, reps = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1
c = kda_props.draw(seed, "gpu")
for r in range(reps):
    bad = kda_props.check(c, "cuda")
    torch.cuda.synchronize()
    print(seed, r, "OK" if not bad else bad[:2], flush=True)
