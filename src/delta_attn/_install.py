"""How to install each optional package: one hint per package, quoted by every error, by ``delta-attn env``, by
the benchmark's rows and by the README and docs (tests/project/test_install_hints.py holds them to it).

Each hint names the package itself (works in any environment, a checkout included); where an extra of this
project installs it too, the extra follows as the alternative, spelled for a checkout. cuDNN has one route:
the frontend without its declared dependencies (CuTe DSL and TVM FFI serve engines delta-attn does not run:
docs/DISPATCH.md), plus cuda-python, which cuDNN's KDA engine compiles its kernel with (NVRTC, through
``cuda.bindings``; it also needs the CUDA headers: CUDA_HOME or the nvidia-cuda-runtime wheel).
"""

TRITON = "pip install triton"
CUDNN = "pip install --no-deps 'nvidia-cudnn-frontend>=1.32' && pip install cuda-python"
FLA = "pip install fla-core (or, in a delta-attn checkout, the extra: pip install -e '.[peers]')"
BENCH = "pip install matplotlib tqdm (or, in a delta-attn checkout, the extra: pip install -e '.[bench]')"
TRANSFORMERS = ("pip install 'transformers>=4.53' (or, in a delta-attn checkout, the extra: "
                "pip install -e '.[transformers]')")
