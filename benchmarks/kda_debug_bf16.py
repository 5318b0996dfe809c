"""Localise the GPU fuzz's illegal addresses (experiment script: deleted once measured).
    CUDA_LAUNCH_BLOCKING=1 python benchmarks/kda_debug_bf16.py SEED ...   fuzz configurations in one process"""
import sys
import traceback

import torch

sys.path.insert(0, "tests")
import kda_props  # noqa: E402

args = sys.argv[1:]
if args and args[0] in ("stages1", "rowclamp"):
    from delta_attn.ops.kda import pipeline
    real = pipeline.scan_tiles
    mode = args.pop(0)
    if mode == "stages1":
        pipeline.scan_tiles = lambda *a: tuple(t.with_(num_stages=1) for t in real(*a))
    print("mode", mode, flush=True)
for arg in args:
    seed, _, dt = arg.partition(":")
    c = kda_props.draw(int(seed), "gpu")
    if dt:
        c = kda_props.Case(**{**c.__dict__, "dtype": dt})
    try:
        bad = kda_props.check(c, "cuda")
        torch.cuda.synchronize()
        print(arg, "OK" if not bad else bad[:2], flush=True)
    except Exception:
        print(arg, "EXCEPTION", c, flush=True)
        traceback.print_exc()
        break
