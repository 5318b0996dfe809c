"""Seeded random attention calls and the check that a backend computes the contract or declares the call
unsupported: :func:`draw` gives a :class:`Case` (dense or varlen, zero-length sequences, Sq > Sk, causal, windows,
GQA, odd head dims, negative and zero scales, softcap, fp32 / fp16 / bf16 / fp64), :func:`run_case` runs it on a
backend against the float64 reference by the error rule (docs/TESTING.md). Shared by
tests/ops/test_backend_capabilities.py and tests/gpu/test_sdpa_gpu.py.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import pytest
import torch

import delta_attn as da
from delta_attn import reference
from delta_attn.backends import UnsupportedError
from delta_attn.testing import attention_grad_floor, check, poison_outputs

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
DTYPE_DRAW = ["fp32", "fp16", "bf16"] * 2 + ["fp64"]
WINDOWS = [(-1, -1), (-1, -1), (0, -1), (3, 2), (2, 0), (-1, 3), (0, 0), (6, -1)]
SCALES = [None, None, 0.3, -0.5, -1.7, 0.0, 2.0]


@dataclass(frozen=True)
class Case:
    seed: int
    dtype: str
    b: int
    sq: int
    sk: int
    hq: int
    hk: int
    d: int
    causal: bool
    window: Tuple[int, int]
    scale: Optional[float]
    lens_q: Optional[Tuple[int, ...]]     # varlen when given (b, sq, sk unused)
    lens_k: Optional[Tuple[int, ...]]
    layout: str
    grad: bool
    softcap: float = 0.0                  # declared unsupported by sdpa / cudnn: the refusal path

    def __str__(self):
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


def draw(seed: int, domain: str = "cpu") -> Case:
    """One configuration. ``domain="gpu"`` draws longer sequences and larger head dims."""
    r = random.Random(seed)
    gpu = domain == "gpu"
    lengths = [1, 5, 17, 33, 40] if not gpu else [1, 63, 97, 257, 300]
    dims = [16, 32, 48, 20] if not gpu else [64, 128, 96, 36]
    d = r.choice(dims)
    hk = r.choice([1, 2])
    hq = hk * r.choice([1, 1, 4])
    if r.random() < 0.35:
        n = r.randint(1, 4)
        lens_q = tuple(r.choice([0, 1, r.choice(lengths)]) for _ in range(n))
        lens_k = tuple(r.choice([0, 1, r.choice(lengths)]) for _ in range(n))
        if r.random() < 0.3:
            lens_k = lens_q
        b, sq, sk = 1, max(lens_q), max(lens_k)
        layout = r.choice(["thd", "htd"])
    else:
        lens_q = lens_k = None
        b, sq, sk = r.randint(1, 2), r.choice(lengths), r.choice(lengths + [0])
        layout = "thd"
    return Case(seed, r.choice(DTYPE_DRAW), b, sq, sk, hq, hk, d, r.random() < 0.4, r.choice(WINDOWS),
                r.choice(SCALES), lens_q, lens_k, layout, r.random() < 0.35, 4.0 if r.random() < 0.12 else 0.0)


def cu_seqlens(lens, device):
    """int32 cu_seqlens of sequence lengths ``lens``."""
    return torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=device)


def make_call(case: Case, device="cpu"):
    """(function, positional args, keyword args, reference(q, k, v, upcast) -> (out, lse))."""
    g = torch.Generator().manual_seed(case.seed)
    dt = DTYPES[case.dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    kw = dict(causal=case.causal, window_size=case.window, softmax_scale=case.scale, softcap=case.softcap)
    rkw = dict(kw)
    if case.lens_q is None:
        q, k, v = randn(case.b, case.sq, case.hq, case.d), randn(case.b, case.sk, case.hk, case.d), \
            randn(case.b, case.sk, case.hk, case.d)

        def ref(q_, k_, v_, upcast):
            return reference.attention(q_, k_, v_, upcast=upcast, **rkw)
        return da.flash_attn_func, (q, k, v), kw, ref
    cu_q, cu_k = cu_seqlens(case.lens_q, device), cu_seqlens(case.lens_k, device)
    if case.lens_k == case.lens_q:
        cu_k = cu_q
    tq, tk = sum(case.lens_q), sum(case.lens_k)

    def packed(t, h):
        return randn(t, h, case.d) if case.layout == "thd" else randn(h, t, case.d)
    q, k, v = packed(tq, case.hq), packed(tk, case.hk), packed(tk, case.hk)

    def ref(q_, k_, v_, upcast):
        return reference.attention_varlen(q_, k_, v_, cu_q, cu_k, layout=case.layout, upcast=upcast, **rkw)
    kw["layout"] = case.layout
    return (da.flash_attn_varlen_func, (q, k, v, cu_q, cu_k, max(case.lens_q), max(case.lens_k)), kw, ref)


def _grads(out, xs, dout):
    """d(out . dout)/d(xs); None for an input out does not depend on (the reference builds rows that see
    no key from scratch)."""
    if out.grad_fn is None:
        return (None,) * len(xs)
    return torch.autograd.grad(out, xs, dout.to(out.dtype), allow_unused=True)


def run_case(case: Case, backend: str, device="cpu") -> str:
    """'ran' (and matched the reference) or 'declared' (and is passed over / refused with reasons)."""
    fn, args, kw, ref = make_call(case, device)
    ex = da.explain(fn, *args, backend=backend, **kw)
    if ex.chosen is None:
        reasons = ex.considered[0][1]
        assert reasons, f"{backend}: no backend chosen and no reason given\n{ex}"
        with pytest.raises(UnsupportedError) as err:
            fn(*args, backend=backend, **kw)
        assert all(r in str(err.value) for r in reasons), (str(err.value), reasons)
        auto = da.explain(fn, *args, **kw)
        assert auto.chosen != backend and dict(auto.considered)[backend] == reasons
        assert f"{backend}: passed over — " + "; ".join(reasons) in str(auto)
        return "declared"
    q, k, v = args[:3]
    leaves = [t.detach().clone().requires_grad_(case.grad) for t in (q, k, v)]
    with poison_outputs():
        out, lse, _ = fn(*leaves, *args[3:], return_attn_probs=True, backend=backend, **kw)
    r64 = [t.detach().double().requires_grad_(case.grad) for t in (q, k, v)]
    rlo = [t.detach().clone().requires_grad_(case.grad) for t in (q, k, v)]
    o64, l64 = ref(*r64, upcast=True)
    olo, llo = ref(*rlo, upcast=False)
    verdicts = [check(out, o64, olo, name="out"), check(lse, l64, llo, name="lse")]
    if case.grad and out.numel():
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed + 1)).to(out)
        got, want64, wantlo = (_grads(o, xs, dout) for o, xs in ((out, leaves), (o64, r64), (olo, rlo)))
        full = [tuple(torch.zeros_like(leaf) if t is None else t for t in ts)
                for ts, leaf in zip(zip(got, want64, wantlo), leaves)]
        floor = attention_grad_floor([w64 for _, w64, _ in full], q.dtype)
        for name, (a, w64, wlo) in zip(("dq", "dk", "dv"), full):
            verdicts.append(check(a, w64, wlo, kind="grad", name=name, floor=floor))
    bad = [v.message for v in verdicts if not v.ok]
    assert not bad, f"backend {backend!r} chose to run {case} but: " + "; ".join(bad)
    return "ran"
