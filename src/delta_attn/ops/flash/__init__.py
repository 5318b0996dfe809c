"""Attention: flash attention (``flash``, ``flash_varlen``) and KV-cache decode (``flash_kvcache``).

The file roles are those of every operator package (docs/ARCHITECTURE.md, "Package layout"):
``args.py`` the validated calls backends receive (imports no backend); ``api.py`` validation and the public
functions; ``register.py`` what each backend supports, registered when this package is imported;
``launch.py`` host launchers of the Triton kernels; ``autograd.py`` their custom ops, autograd Function and
backend entries; ``kernels_fwd.py`` / ``kernels_bwd.py`` / ``kernels_decode.py`` the Triton kernels;
``torch_impl.py`` the reference backend; ``cudnn.py`` / ``sdpa.py`` the peer backends, and ``contract.py`` what
both do before their kernels so that they compute the contract.
"""
from .register import register_backends

register_backends()
