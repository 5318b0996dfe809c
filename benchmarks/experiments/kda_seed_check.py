"""Seeded KDA configurations against the float64 reference, on the delta-attn tree first on PYTHONPATH: run it once
per candidate tree to see which one a failing GPU seed passes.

PYTHONPATH=<tree>/src python benchmarks/experiments/kda_seed_check.py 241 p219 997
N is test_kda_gpu.py's seed N, pN the Triton backend's KDA property seed N of test_properties_gpu.py. One line per
seed: PASS or FAIL with the error rule's messages. Without a GPU it runs on Triton's interpreter, bf16 with the
GPU's emulated bf16 arithmetic (tests/gluon_emulator.py).
"""
import contextlib
import os
import pathlib
import sys
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before Triton is imported
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
import properties as P  # noqa: E402
from gluon_emulator import triton_bf16_on_cpu  # noqa: E402

import delta_attn  # noqa: E402


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"tree {pathlib.Path(delta_attn.__file__).parent}, device {dev}", flush=True)
    mp = pytest.MonkeyPatch()
    with triton_bf16_on_cpu(mp) if dev == "cpu" else contextlib.nullcontext():
        for tok in sys.argv[1:]:
            t0 = time.time()
            try:
                if tok.startswith("p"):
                    P.Checker(P.draw("kda", 100_000 + int(tok[1:]), "gpu"), dev).check("triton")
                    bad = []
                else:
                    bad = P.kda_check(P.draw_kda(10_000 + int(tok), "gpu"), dev)
            except Exception as e:      # noqa: BLE001
                bad = [f"{type(e).__name__}: {str(e)[:400]}"]
            print(f"{tok}: {'FAIL' if bad else 'PASS'} {time.time() - t0:.1f}s {'; '.join(bad)}", flush=True)
    mp.undo()


if __name__ == "__main__":
    main()
