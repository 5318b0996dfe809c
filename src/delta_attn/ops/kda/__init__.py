"""Kimi Delta Attention (``kda``) and its decode step on a state pool (``kda_step``).

The file roles are those of every operator package (docs/ARCHITECTURE.md, "Package layout"): ``args.py`` the
validated call (imports no backend); ``api.py`` validation and the public functions; ``register.py`` what each
backend supports, registered when this package is imported; ``launch.py`` host launchers, precision and tiles;
``autograd.py`` custom ops, autograd Function and backend entries; ``kernels_intra.py`` / ``kernels_scan.py`` /
``kernels_backward.py`` / ``kernels_carry.py`` / ``kernels_decode.py`` the Triton kernels, ``kernels_gate.py``
their shared ``@jit`` helpers; ``cudnn.py`` the cuDNN frontend backend; ``torch_impl.py`` the reference backend.
"""
from .register import register_backends

register_backends()
