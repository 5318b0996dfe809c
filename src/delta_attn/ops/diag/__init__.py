"""Gated diagonal attention: ``s_t = exp(g_t) * s_{t-1} + k_t * v_t``, ``o_t = q_t * s_t`` (``diag``), and its
decode step on a state pool (``diag_step``).

The file roles are those of every operator package (docs/ARCHITECTURE.md, "Package layout"): ``args.py`` the
validated call (imports no backend); ``api.py`` validation and the public functions; ``register.py`` what each
backend supports, registered when this package is imported; ``launch.py`` host launchers; ``autograd.py`` custom
ops, autograd Function and backend entries; ``kernels_scan.py`` / ``kernels_decode.py`` the Triton kernels;
``torch_impl.py`` the reference backend.
"""
from .register import register_backends

register_backends()
