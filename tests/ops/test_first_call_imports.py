"""A first eager call imports no torch.compile machinery: torch._dynamo and sympy cost 1-4 s of a cold start,
and an eager call needs neither (CPU: KDA and the diagonal operator; flash attention's Triton backend has no CPU path) (the ops' bodies run without their custom-op dispatch: ``eager_or_op``; the
training forward's backward compile on meta tensors avoids torch's Python meta functions)."""
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent('''
    import os, sys
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import delta_attn as da
    torch.manual_seed(0)
    x = lambda *s: torch.randn(*s, requires_grad=True)
    q, k, v = x(1, 20, 2, 16), x(1, 20, 2, 16), x(1, 20, 2, 16)
    g = (-torch.rand(1, 20, 2, 16)).requires_grad_()
    beta = torch.rand(1, 20, 2).requires_grad_()
    op = sys.argv[1]
    if op == "kda":
        o, _ = da.kda(q, k, v, g, beta, use_qk_l2norm=True, backend="triton")
    else:
        o, _ = da.gated_diag_attn(q, k, v, g, backend="triton")
    o.sum().backward()
    print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
''')


@pytest.mark.parametrize("op", ["kda", "diag"])
def test_first_eager_forward_backward_imports_no_compile_machinery(op):
    out = subprocess.run([sys.executable, "-c", CHILD, op], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
