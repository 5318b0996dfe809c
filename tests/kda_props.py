"""Seeded random KDA configurations (property-based tests), shared by the CPU suite and the GPU fuzz.

``draw(seed, domain)`` gives one configuration: shapes (odd lengths, varlen with empty sequences, GVA),
dtype, gate form, l2 norm, initial / final state, decay regime (down to -1e4 and -inf), scale, and whether
gradients are checked. ``check(case, device)`` runs ``da.kda`` on the Triton backend with poisoned outputs
and applies DESIGN.md's error rule against the float64 reference (the baseline: the same recurrence in the
input dtype) to the output, the final state and every gradient.

Keys are drawn with ``‖k‖ ~ 1`` when q / k are not L2-normalised: the delta rule is a contraction only
for ``beta ‖k‖² <= 2``, and beyond it every implementation (the reference included) diverges.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch

import delta_attn as da
from delta_attn import reference as ref
from delta_attn.testing import check as rule, poison_outputs

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    seed: int
    B: int
    T: int
    cu: Optional[tuple]
    H: int
    HV: int
    K: int
    V: int
    dtype: str
    gate: Optional[str]          # None (g is the log decay), "softplus", "lower_bound"
    l2: bool
    h0: bool
    final: bool
    decay: Optional[float]       # strong decay planted at 15 % of (token, channel) pairs
    scale: Optional[float]
    fp32_gb: bool                # g and beta in float32 with low-precision q / k / v
    grad: bool

    def __str__(self):
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


# (K, V) pairs of the GPU domain: every multiple of 16 up to 256 appears as K and as V
GPU_DIMS = [(16 * (i + 1), 16 * ((7 * i + 3) % 16 + 1)) for i in range(16)]


def draw(seed: int, domain: str = "cpu") -> Case:
    r = random.Random(seed)
    gpu = domain == "gpu"
    if gpu:
        K, V = r.choice(GPU_DIMS)
        dtype = r.choice(["bf16", "bf16", "fp16", "fp32"])
        tmax = r.choice([70, 300, 1100])
    else:
        K, V = r.choice([16, 32, 48]), r.choice([16, 32, 48])
        dtype = r.choice(["fp32", "fp16"])
        tmax = r.choice([40, 100])
    H = r.choice([1, 2])
    HV = H * r.choice([1, 1, 2, 4])
    if r.random() < 0.4:
        n = r.randint(1, 5)
        lens = [r.choice([0, 1, r.randint(1, tmax)]) for _ in range(n)]
        if sum(lens) == 0:
            lens[-1] = 1
        cu = tuple([0] + [sum(lens[:i + 1]) for i in range(n)])
        B, T = 1, cu[-1]
    else:
        cu, B, T = None, r.randint(1, 3), r.choice([1, r.randint(2, tmax)])
    gate = r.choice([None, None, "softplus", "lower_bound"])
    decay = r.choice([None, None, None, -50.0, -1e4, float("-inf")]) if gate is None else None
    return Case(seed, B, T, cu, H, HV, K, V, dtype, gate, r.random() < 0.6, r.random() < 0.5, r.random() < 0.6,
                decay, r.choice([None, None, 0.3]), dtype != "fp32" and r.random() < 0.3, r.random() < 0.5)


def inputs(c: Case, device):
    gen = torch.Generator().manual_seed(c.seed)
    dt = DTYPES[c.dtype]
    gb = torch.float32 if c.fp32_gb else dt
    rnd = lambda *s: torch.randn(*s, generator=gen)          # noqa: E731
    q = rnd(c.B, c.T, c.H, c.K)
    k = rnd(c.B, c.T, c.H, c.K) * (1.0 if c.l2 else c.K ** -0.5)
    v = rnd(c.B, c.T, c.HV, c.V)
    if c.gate is None:
        g = torch.nn.functional.logsigmoid(rnd(c.B, c.T, c.HV, c.K) + 2.0)
        if c.decay is not None:
            hit = torch.rand(c.B, c.T, c.HV, c.K, generator=gen) < 0.15
            g = torch.where(hit, torch.full_like(g, c.decay), g)
    else:
        g = rnd(c.B, c.T, c.HV, c.K)
    beta = torch.rand(c.B, c.T, c.HV, generator=gen)
    xs = [q.to(dt), k.to(dt), v.to(dt), g.to(gb), beta.to(gb)]
    kw = {}
    if c.gate is not None:
        kw["A_log"] = rnd(c.HV) * 0.5
        kw["dt_bias"] = rnd(c.HV * c.K) * 0.5
        if c.gate == "lower_bound":
            kw["lower_bound"] = -5.0
    n = c.B if c.cu is None else len(c.cu) - 1
    if c.h0:
        kw["initial_state"] = rnd(n, c.HV, c.K, c.V) * 0.5
    if c.cu is not None:
        kw["cu_seqlens"] = torch.tensor(c.cu, dtype=torch.int32)
    xs = [x.to(device) for x in xs]
    kw = {n_: (t.to(device) if torch.is_tensor(t) else t) for n_, t in kw.items()}
    return xs, kw


_GRAD_KW = ("initial_state", "A_log", "dt_bias")


def run(backend: str, xs, kw, grad: bool, seed: int, **opts):
    """(o, final, grads) of a ``da.kda`` backend ("triton", "cudnn", ...) or of the reference: "ref64" (float64)
    or "ref_low" (the input dtype). The loss weights come from a CPU generator seeded with ``seed``."""
    if backend == "ref64":
        xs = [x.double() for x in xs]
        kw = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in kw.items()}
    if grad:
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
        kw = {n: (t.detach().clone().requires_grad_(True) if n in _GRAD_KW else t) for n, t in kw.items()}
    with poison_outputs():
        if backend.startswith("ref"):
            o, s = ref.kda(*xs, **kw, upcast=backend == "ref64", **opts)
        else:
            o, s = da.kda(*xs, **kw, backend=backend, **opts)
        if not grad:
            return o, s, []
        gen = torch.Generator().manual_seed(seed)
        loss = (o * torch.randn(o.shape, generator=gen).to(o.device, o.dtype)).sum()
        if s is not None:
            loss = loss + (s * torch.randn(s.shape, generator=gen).to(s.device, s.dtype)).sum()
        leaves = xs + [kw[n] for n in _GRAD_KW if n in kw]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return o, s, [torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves, grads)]


def compare(xs, kw, grad: bool, seed: int, backend: str = "triton", **opts):
    """(failures, outputs of the backend): DESIGN.md's error rule on o, the final state (float32) and every
    gradient against the float64 reference, with the same recurrence in the input dtype as the baseline."""
    out = run(backend, xs, kw, grad, seed, **opts)
    r64 = run("ref64", xs, kw, grad, seed, **opts)
    low = run("ref_low", xs, kw, grad, seed, **opts)
    pairs = [("o", out[0], r64[0], low[0], "fwd")]
    if out[1] is not None:
        if out[1].dtype != torch.float32:
            return [f"final_state dtype {out[1].dtype}"], out
        pairs.append(("final_state", out[1], r64[1], low[1], "fwd"))
    gnames = ["dq", "dk", "dv", "dg", "dbeta"] + ["d_" + n for n in _GRAD_KW if n in kw]
    pairs += [(n, a, b, cc, "grad") for n, a, b, cc in zip(gnames, out[2], r64[2], low[2])]
    bad = [v.message for v in (rule(a, b, cc, kind=kind, name=n) for n, a, b, cc, kind in pairs) if not v.ok]
    return bad, out


def check(c: Case, device="cpu") -> List[str]:
    """The failures of one configuration on the Triton backend (empty when it passes)."""
    xs, kw = inputs(c, device)
    return compare(xs, kw, c.grad, c.seed, use_qk_l2norm=c.l2, output_final_state=c.final, scale=c.scale)[0]
