"""Seeded random configurations of every public operator (property-based tests), shared by the CPU suite
(tests/ops/test_properties.py), the GPU suite (tests/gpu/test_properties_gpu.py) and the KDA suites.

``draw(op, seed, domain)`` gives one :class:`Case` of ``flash_attn_func`` ("flash"),
``flash_attn_varlen_func`` ("flash_varlen"), ``kda``, ``kda_step``, ``gated_diag_attn`` ("diag") or
``gated_diag_step`` ("diag_step"): odd lengths (1, 17, 63, 97, ...), Sq != Sk, GQA 1/4/8, zero-length varlen
sequences, rows that see no key, windows ((0, -1) included), softcap, ALiBi, negative / tiny / large finite
scales, decays down to -1e4 and -inf, initial / final states, state pools with permuted ``state_indices``,
the KDA gate options (A_log / dt_bias / lower_bound), use_qk_l2norm, GVA, NaN gates planted in one sequence,
and non-contiguous views of tensor arguments (index tensors included; their padding holds NaN or an
out-of-range index, so a kernel that reads it fails). ``domain="cpu"`` keeps shapes tiny (the Triton
interpreter), ``"gpu"`` draws longer sequences from a fixed set of head dims (few Triton specialisations).

``Checker(case, device)`` builds the inputs once; ``checker.check(backend)`` asks ``da.explain`` whether the
backend can run the call. If it cannot (the honest-capabilities check), an explicit request must raise
``UnsupportedError`` naming every reason and ``auto`` must pass the backend over with the same reasons. If it
can, the call runs with poisoned outputs and every output (and, for a third of the configurations, every
gradient) must pass the error rule (docs/TESTING.md, ``delta_attn.testing.check``) against the float64 reference, with the
same computation in the input dtype as the baseline. A planted NaN must stay in its own sequence: where the
reference is NaN the result must be NaN, the other sequences must pass the rule.

The KDA generator of the earlier ``kda_props`` module lives here too (``KDACase``, ``draw_kda``,
``kda_inputs``, ``kda_compare``, ``kda_check``: the Triton KDA suites and the cuDNN KDA tests use them).
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

import delta_attn as da
from delta_attn import reference as ref, settings
from delta_attn.backends import UnsupportedError
from delta_attn.testing import attention_grad_floor, check as rule, poison_outputs

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
OPS = ("flash", "flash_varlen", "kda", "kda_step", "diag", "diag_step")
FUNCTIONS = {"flash": da.flash_attn_func, "flash_varlen": da.flash_attn_varlen_func, "kda": da.kda,
             "kda_step": da.kda_step, "diag": da.gated_diag_attn, "diag_step": da.gated_diag_step}
INF = float("inf")

# =============================================================================================
# KDA configurations (the former kda_props: its draws are unchanged for domains "cpu" and "gpu")
# =============================================================================================


@dataclass(frozen=True)
class KDACase:
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
    corr: Optional[float] = None  # keys w * shared + (1 - w) * own (unit norm), beta in [0.75, 1): A near 1

    def __str__(self):
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


# (K, V) pairs of the GPU domain: every multiple of 16 up to 256 appears as K and as V
GPU_DIMS = [(16 * (i + 1), 16 * ((7 * i + 3) % 16 + 1)) for i in range(16)]
# the property suites' fixed dims (few Triton specialisations; K = V = 128 is what cuDNN's KDA runs)
PROPS_GPU_DIMS = [(128, 128), (128, 128), (64, 64), (64, 128), (32, 64)]


def draw_kda(seed: int, domain: str = "cpu") -> KDACase:
    """``domain``: "cpu" (K, V up to 48, T up to 100), "gpu" (every K, V multiple of 16 up to 256), "tiny"
    (the interpreter budget of the property suite), "gpu-props" (fixed dims, bf16 / fp16)."""
    r = random.Random(seed)
    if domain in ("gpu", "gpu-props"):
        K, V = r.choice(GPU_DIMS if domain == "gpu" else PROPS_GPU_DIMS)
        dtype = r.choice(["bf16", "bf16", "fp16", "fp32"])
        if domain == "gpu-props" and dtype == "fp32":
            dtype = "fp16"
        tmax = r.choice([70, 300, 1100])
    elif domain == "tiny":
        K, V = r.choice([16, 32]), r.choice([16, 16, 32])
        dtype = r.choice(["fp32", "fp16", "fp16", "bf16"])
        tmax = r.choice([6, 20])
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
    return KDACase(seed, B, T, cu, H, HV, K, V, dtype, gate, r.random() < 0.6, r.random() < 0.5, r.random() < 0.6,
                   decay, r.choice([None, None, 0.3]), dtype != "fp32" and r.random() < 0.3, r.random() < 0.5)


def _log_decay(gen: torch.Generator, shape, decay: Optional[float]) -> torch.Tensor:
    """logsigmoid(N(2, 1)) (mild decays), with ``decay`` planted at 15 % of the entries."""
    g = torch.nn.functional.logsigmoid(torch.randn(*shape, generator=gen) + 2.0)
    if decay is not None:
        hit = torch.rand(*shape, generator=gen) < 0.15
        g = torch.where(hit, torch.full_like(g, decay), g)
    return g


def kda_inputs(c: KDACase, device):
    """([q, k, v, g, beta], keyword tensors) of one KDA configuration, on ``device``."""
    gen = torch.Generator().manual_seed(c.seed)
    dt = DTYPES[c.dtype]
    gb = torch.float32 if c.fp32_gb else dt
    rnd = lambda *s: torch.randn(*s, generator=gen)          # noqa: E731
    q = rnd(c.B, c.T, c.H, c.K)
    k = rnd(c.B, c.T, c.H, c.K) * (1.0 if c.l2 else c.K ** -0.5)
    v = rnd(c.B, c.T, c.HV, c.V)
    g = _log_decay(gen, (c.B, c.T, c.HV, c.K), c.decay) if c.gate is None else rnd(c.B, c.T, c.HV, c.K)
    beta = torch.rand(c.B, c.T, c.HV, generator=gen)
    if c.corr is not None:       # nearly parallel keys (a generator of their own: the other inputs as without)
        unit = lambda x: x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)       # noqa: E731
        shared = unit(torch.randn(1, 1, c.H, c.K, generator=torch.Generator().manual_seed(c.seed + 1)))
        k = unit(c.corr * shared + (1 - c.corr) * unit(k))
        beta = 0.75 + 0.25 * beta
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


def _loss_grads(outputs: List[Optional[torch.Tensor]], leaves: List[torch.Tensor], seed: int,
                dtypes: List[torch.dtype]) -> List[torch.Tensor]:
    """Gradients of sum_i <outputs[i], W_i> (W_i drawn from a CPU generator seeded with ``seed``, the same for
    every implementation) with respect to ``leaves``; zeros for a leaf the outputs do not depend on.

    ``dtypes[i]`` is the dtype of output i as the backends return it: W_i is rounded to it for every implementation,
    the float64 reference included. The cotangent is an input of the backward like q, k and v (which the reference
    takes rounded to the input dtype, as flash-attn's tests draw ``dout`` in the output's dtype): with W_i in full
    precision for the reference only, its rounding to fp16 (2^-11 relative) counted as every fp16 backend's error
    (KDA seed 100092 on the GPU domain: dA_log off by 1.0e-4 of 0.144, 99.8 % of the fp32 torch backend's error)."""
    gen = torch.Generator().manual_seed(seed)
    loss = 0
    for o, dt in zip(outputs, dtypes):
        if o is not None:
            loss = loss + (o * torch.randn(o.shape, generator=gen).to(dt).to(o.device, o.dtype)).sum()
    if not torch.is_tensor(loss) or loss.grad_fn is None:
        return [torch.zeros_like(t) for t in leaves]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves, grads)]


def kda_run(backend: str, xs, kw, grad: bool, seed: int, **opts):
    """(o, final, grads) of a ``da.kda`` backend ("triton", "cudnn", ...) or of the reference: "ref64" (float64)
    or "ref_low" (the input dtype). The loss weights come from a CPU generator seeded with ``seed``, rounded to the
    dtypes a backend returns (o in v's dtype, the final state float32; float64 for float64 inputs)."""
    wide = ref.accumulation_dtype(xs[2].dtype)
    out_dtypes = [xs[2].dtype, wide]
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
        leaves = xs + [kw[n] for n in _GRAD_KW if n in kw]
        return o, s, _loss_grads([o, s], leaves, seed, out_dtypes)


def kda_compare(xs, kw, grad: bool, seed: int, backend: str = "triton", **opts):
    """(failures, outputs of the backend): the error rule on o, the final state (float32) and every
    gradient against the float64 reference, with the same recurrence in the input dtype as the baseline."""
    out = kda_run(backend, xs, kw, grad, seed, **opts)
    r64 = kda_run("ref64", xs, kw, grad, seed, **opts)
    low = kda_run("ref_low", xs, kw, grad, seed, **opts)
    pairs = [("o", out[0], r64[0], low[0], "fwd")]
    if out[1] is not None:
        if out[1].dtype != torch.float32:
            return [f"final_state dtype {out[1].dtype}"], out
        pairs.append(("final_state", out[1], r64[1], low[1], "fwd"))
    gnames = ["dq", "dk", "dv", "dg", "dbeta"] + ["d_" + n for n in _GRAD_KW if n in kw]
    pairs += [(n, a, b, cc, "grad") for n, a, b, cc in zip(gnames, out[2], r64[2], low[2])]
    bad = [v.message for v in (rule(a, b, cc, kind=kind, name=n) for n, a, b, cc, kind in pairs) if not v.ok]
    return bad, out


def kda_check(c: KDACase, device="cpu") -> List[str]:
    """The failures of one KDA configuration on the Triton backend (empty when it passes)."""
    xs, kw = kda_inputs(c, device)
    return kda_compare(xs, kw, c.grad, c.seed, use_qk_l2norm=c.l2, output_final_state=c.final, scale=c.scale)[0]


# =============================================================================================
# every operator: configurations
# =============================================================================================


@dataclass(frozen=True)
class Case:
    """One configuration of one operator. ``p`` holds the operator's parameters, ``strided`` the tensor
    arguments passed as non-contiguous views (name -> "pad" | "step" | "swap"), ``nan`` the sequence whose gate
    holds a NaN (None: none)."""
    op: str
    seed: int
    domain: str
    dtype: str
    grad: bool
    p: Dict[str, object] = field(default_factory=dict)
    strided: Dict[str, str] = field(default_factory=dict)
    nan: Optional[int] = None

    def __str__(self):
        p = " ".join(f"{k}={v}" for k, v in self.p.items())
        return (f"{self.op} seed={self.seed} domain={self.domain} dtype={self.dtype} grad={self.grad} {p} "
                f"strided={self.strided or None} nan_in_sequence={self.nan}\n"
                f"  repro: properties.Checker(properties.draw({self.op!r}, {self.seed}, {self.domain!r}), "
                f"device).check(backend)")


_DOMAIN = {
    "cpu": dict(lengths=[1, 1, 2, 5, 17, 17, 33], long=[63, 97], dims=[16, 16, 32, 48, 8], odd_dims=[20, 12],
                dtypes=["fp16", "fp16", "fp16", "fp16", "fp32", "fp32", "bf16", "fp64"], tmax=20, heads=[1, 2],
                diag_dims=[8, 16, 20, 48], windows=[(3, 2), (2, 0), (-1, 3), (0, 0), (6, -1), (0, -1)]),
    "gpu": dict(lengths=[1, 17, 63, 97, 128, 257, 300], long=[1025, 2048], dims=[64, 64, 128, 128, 96, 48],
                odd_dims=[36], dtypes=["bf16", "fp16"], tmax=600, heads=[1, 2, 4],
                diag_dims=[64, 128, 96], windows=[(126, -1), (3, 2), (64, 0), (-1, 17), (0, 0), (255, 31), (0, -1)]),
}
# softmax scales: default, ordinary, negative, zero, tiny, large (very negative visible scores)
SCALES = [None, None, None, 0.3, -0.5, -1.7, 0.0, 1e-30, 2.0, 25.0, -40.0]
STRIDE_KINDS = ("pad", "step", "swap")


def _strided_names(r: random.Random, names, prob: float) -> Dict[str, str]:
    """Which tensor arguments are non-contiguous views (index tensors more often: their defects corrupt memory)."""
    index = ("cu_seqlens", "cu_seqlens_q", "cu_seqlens_k", "state_indices")
    return {n: r.choice(STRIDE_KINDS) for n in names if r.random() < (0.35 if n in index else prob)}


def _lens(r: random.Random, n: int, lengths, zero: float = 0.25) -> List[int]:
    return [0 if r.random() < zero else r.choice(lengths) for _ in range(n)]


def _draw_flash(r: random.Random, seed: int, domain: str, varlen: bool) -> Case:
    dm = _DOMAIN[domain]
    dtype = r.choice(dm["dtypes"])
    d = r.choice(dm["odd_dims"]) if r.random() < 0.1 else r.choice(dm["dims"])
    dv = r.choice(dm["dims"]) if r.random() < 0.08 else d
    hk = r.choice(dm["heads"][:2])
    hq = hk * r.choice([1, 1, 4, 8])
    lengths = dm["lengths"] + (dm["long"] if r.random() < 0.1 else [])
    causal = r.random() < 0.4
    window = r.choice(dm["windows"]) if r.random() < 0.4 else (-1, -1)
    scale = r.choice(SCALES)
    p = dict(d=d, dv=dv, hq=hq, hk=hk, causal=causal, window=window, scale=scale,
             softcap=r.choice([0.0] * 7 + [5.0, 0.5]), alibi=r.random() < 0.12, deterministic=r.random() < 0.1)
    if varlen:
        n = r.randint(1, 5)
        lens_q = _lens(r, n, lengths)
        lens_k = lens_q if r.random() < 0.3 else _lens(r, n, lengths)
        if r.random() < 0.15:      # a key sequence of length 0 or 1 next to longer ones (the flash backward edge)
            lens_k = [r.choice([0, 1]) if i % 2 == 0 else max(x, 17) for i, x in enumerate(lens_k)]
            lens_q = [max(x, 17) for x in lens_q]
            scale = p["scale"] = r.choice([-40.0, 25.0, None])
        p.update(lens_q=tuple(lens_q), lens_k=tuple(lens_k), same_cu=lens_k is lens_q and r.random() < 0.7,
                 layout=r.choice(["thd", "htd"]), cu_dtype=r.choice(["int32", "int32", "int64"]))
        names = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes"]
    else:
        b, sq, sk = r.randint(1, 2), r.choice(lengths), r.choice(lengths + [0])
        if r.random() < 0.12:      # one key against 17 queries, very negative / large visible scores
            sq, sk, p["scale"] = 17, 1, r.choice([-40.0, 25.0, None])
        elif domain == "gpu" and r.random() < 0.04:
            sq, sk, p["window"] = 2936, 257, r.choice([(126, -1), (-1, -1)])    # cuDNN's ragged edge
        p.update(b=b, sq=sq, sk=sk)
        names = ["q", "k", "v", "alibi_slopes"]
    grad = r.random() < 1 / 3
    return Case("flash_varlen" if varlen else "flash", seed, domain, dtype, grad, p,
                _strided_names(r, names, 0.15))


def _draw_kda(r: random.Random, seed: int, domain: str) -> Case:
    kc = draw_kda(seed, "tiny" if domain == "cpu" else "gpu-props")
    kc = replace(kc, grad=r.random() < 1 / 3)
    state64 = kc.h0 and kc.dtype == "fp32" and r.random() < 0.2
    nan = None
    lens = [kc.T] * kc.B if kc.cu is None else [y - x for x, y in zip(kc.cu, kc.cu[1:])]
    if r.random() < 0.1 and kc.T > 0:
        nan = r.choice([i for i, n in enumerate(lens) if n > 0])
        kc = replace(kc, grad=False)
    names = ["q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens"]
    strided = _strided_names(r, names, 0.2)
    if r.random() < 0.2:         # drawn last: every other field as without
        kc = replace(kc, corr=r.choice([0.6, 0.8, 0.95]))
    return Case("kda", seed, domain, kc.dtype, kc.grad, dict(kda=kc, state64=state64), strided, nan)


def _draw_diag(r: random.Random, seed: int, domain: str) -> Case:
    dm = _DOMAIN[domain]
    tmax = dm["tmax"]
    dtype = r.choice([x for x in dm["dtypes"] if x != "fp64"] + ["fp32"] * (domain == "cpu"))
    p = dict(h=r.choice(dm["heads"]), d=r.choice(dm["diag_dims"]),
             decay=r.choice([None, None, None, -50.0, -1e4, float("-inf")]), g32=dtype != "fp32" and r.random() < 0.3,
             h0=r.random() < 0.5, final=r.random() < 0.6, state64=False)
    if r.random() < 0.45:
        lens = _lens(r, r.randint(1, 5), [1, 2, r.randint(1, tmax), r.randint(1, tmax)])
        if sum(lens) == 0:
            lens[-1] = 1
        p.update(b=1, t=sum(lens), lens=tuple(lens), cu_dtype=r.choice(["int32", "int64"]))
    else:
        p.update(b=r.randint(1, 3), t=r.choice([0, 1, r.randint(2, tmax), r.randint(2, tmax)]), lens=None)
    p["state64"] = p["h0"] and dtype == "fp32" and r.random() < 0.2
    lens = [p["t"]] * p["b"] if p["lens"] is None else p["lens"]
    nan = r.choice([i for i, n in enumerate(lens) if n > 0]) if r.random() < 0.15 and p["t"] > 0 else None
    grad = nan is None and r.random() < 1 / 3
    names = ["q", "k", "v", "g", "initial_state", "cu_seqlens"]
    return Case("diag", seed, domain, dtype, grad, p, _strided_names(r, names, 0.2), nan)


def _draw_step(r: random.Random, seed: int, domain: str, op: str) -> Case:
    dm = _DOMAIN[domain]
    b = r.randint(1, 4)
    pool = b + r.choice([0, 0, 1, 3])
    indices = r.choice([None, "int32", "int64"]) if pool == b else r.choice(["int32", "int64"])
    p = dict(b=b, t=r.choice([1, 1, 1, 2, 3]), pool=pool, indices=indices, perm=r.sample(range(pool), b))
    if op == "kda_step":
        kc = draw_kda(seed, "tiny" if domain == "cpu" else "gpu-props")
        kc = replace(kc, B=b, T=p["t"], cu=None, h0=False, final=False, grad=False)
        dtype = kc.dtype
        p.update(kda=kc)
        names = ["q", "k", "v", "g", "beta", "state", "state_indices", "A_log", "dt_bias"]
    else:
        dtype = r.choice([x for x in dm["dtypes"] if x != "fp64"] + ["fp32"] * (domain == "cpu"))
        p.update(h=r.choice(dm["heads"]), d=r.choice(dm["diag_dims"]),
                 decay=r.choice([None, None, -50.0, -1e4, float("-inf")]), g32=dtype != "fp32" and r.random() < 0.3)
        names = ["q", "k", "v", "g", "state", "state_indices"]
    p["state64"] = dtype == "fp32" and r.random() < 0.4
    nan = r.randrange(b) if r.random() < 0.12 else None
    grad = nan is None and r.random() < 0.1       # steps have no backward: declared by every backend
    strided = _strided_names(r, names, 0.2)
    # speculative decoding (docs/SERVING.md): (B, T) slots written after every token, the start slot chosen by
    # num_accepted_tokens (or column 0 without it). Drawn from their own stream: the draws above stay unchanged
    rs = random.Random(f"{op}/{seed}/{domain}/speculative")
    if p["t"] > 1 and rs.random() < 0.4:
        t = p["t"]
        p["pool"] = b * t + rs.choice([0, 2])
        p["indices"] = p["indices"] or "int32"
        p["spec"] = dict(slots=rs.sample(range(p["pool"]), b * t),
                         accepted=[rs.randint(1, t) for _ in range(b)] if rs.random() < 0.7 else None)
        if p["spec"]["accepted"] is not None and rs.random() < 0.35:
            strided["num_accepted_tokens"] = rs.choice(STRIDE_KINDS)
    return Case(op, seed, domain, dtype, grad, p, strided, nan)


def draw(op: str, seed: int, domain: str = "cpu") -> Case:
    """One seeded configuration of ``op`` ("flash", "flash_varlen", "kda", "kda_step", "diag", "diag_step")."""
    r = random.Random(f"{op}/{seed}/{domain}")
    if op in ("flash", "flash_varlen"):
        return _draw_flash(r, seed, domain, op == "flash_varlen")
    if op == "kda":
        return _draw_kda(r, seed, domain)
    if op == "diag":
        return _draw_diag(r, seed, domain)
    if op in ("kda_step", "diag_step"):
        return _draw_step(r, seed, domain, op)
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


# =============================================================================================
# inputs: contiguous tensors, the non-contiguous views handed to the backends
# =============================================================================================


def strided(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The values of ``x`` as a non-contiguous view: "pad" (rows of the last dim padded by 3), "step" (last
    stride 2), "swap" (dims 0 and 1 swapped in memory; "step" for 1-D). The padding holds NaN (floats) or an
    index no tensor has (integers), so a kernel that reads it fails."""
    fill = float("nan") if x.is_floating_point() else -7
    if kind == "swap" and x.dim() >= 2:
        y = torch.full((x.shape[1], x.shape[0]) + tuple(x.shape[2:]), fill, dtype=x.dtype, device=x.device)
        y.copy_(x.transpose(0, 1))
        out = y.transpose(0, 1)
    else:
        last = x.shape[-1]
        wide = torch.full(tuple(x.shape[:-1]) + ((last + 3) if kind == "pad" else 2 * last,), fill,
                          dtype=x.dtype, device=x.device)
        out = wide[..., :last] if kind == "pad" else wide[..., ::2]
        out.copy_(x)
    return out


@dataclass
class Problem:
    """One call: the operator, its tensors (contiguous), other arguments, which tensors are differentiable,
    the reference and how to read the result."""
    fn: Callable
    pos: List[str]                                # positional argument names
    kw: List[str]                                 # keyword argument names
    tensors: Dict[str, torch.Tensor]
    consts: Dict[str, object]
    leaves: List[str]                             # differentiable tensors (gradients checked)
    reference: Callable[[Dict[str, object], bool], Dict[str, torch.Tensor]]
    outputs: Callable[[object, Dict[str, object]], Dict[str, torch.Tensor]]
    sequence_of: Dict[str, torch.Tensor] = field(default_factory=dict)   # output -> sequence index per element
    pools: Tuple[str, ...] = ()                   # tensors updated in place (state pools)
    shared_floor: bool = False                    # one floor for every gradient (flash: testing.attention_grad_floor)


def _cu(lens, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=dtype)


def _flash_problem(c: Case, device) -> Problem:
    p = c.p
    gen = torch.Generator().manual_seed(c.seed)
    dt = DTYPES[c.dtype]
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dt)    # noqa: E731
    consts = dict(softmax_scale=p["scale"], causal=p["causal"], window_size=p["window"], softcap=p["softcap"],
                  deterministic=p["deterministic"], return_attn_probs=True)
    kw = ["softmax_scale", "causal", "window_size", "softcap", "deterministic", "return_attn_probs"]
    tensors = {}
    if c.op == "flash":
        tensors.update(q=rnd(p["b"], p["sq"], p["hq"], p["d"]), k=rnd(p["b"], p["sk"], p["hk"], p["d"]),
                       v=rnd(p["b"], p["sk"], p["hk"], p["dv"]))
        pos = ["q", "k", "v"]
        slopes_shape = (p["hq"],) if p["b"] == 1 or c.seed % 2 else (p["b"], p["hq"])
    else:
        tq, tk = sum(p["lens_q"]), sum(p["lens_k"])
        shape = (lambda t, h, d: (t, h, d)) if p["layout"] == "thd" else (lambda t, h, d: (h, t, d))
        cu_dt = torch.int64 if p["cu_dtype"] == "int64" else torch.int32
        tensors.update(q=rnd(*shape(tq, p["hq"], p["d"])), k=rnd(*shape(tk, p["hk"], p["d"])),
                       v=rnd(*shape(tk, p["hk"], p["dv"])), cu_seqlens_q=_cu(p["lens_q"], cu_dt).to(device),
                       cu_seqlens_k=_cu(p["lens_k"], cu_dt).to(device))
        consts.update(max_seqlen_q=max(p["lens_q"]), max_seqlen_k=max(p["lens_k"]), layout=p["layout"])
        pos = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
        kw.append("layout")
        n = len(p["lens_q"])
        slopes_shape = (p["hq"],) if n == 1 or c.seed % 2 else (n, p["hq"])
    if p["alibi"]:
        tensors["alibi_slopes"] = (torch.rand(slopes_shape, generator=gen) * 0.5).to(device)
        kw.append("alibi_slopes")

    def reference(vals, upcast):
        opts = dict(softmax_scale=p["scale"], causal=p["causal"], window_size=p["window"], softcap=p["softcap"],
                    alibi_slopes=vals.get("alibi_slopes"), upcast=upcast)
        if c.op == "flash":
            out, lse = ref.attention(vals["q"], vals["k"], vals["v"], **opts)
        else:
            out, lse = ref.attention_varlen(vals["q"], vals["k"], vals["v"], vals["cu_seqlens_q"],
                                            vals["cu_seqlens_k"], layout=p["layout"], **opts)
        return {"out": out, "lse": lse}

    return Problem(FUNCTIONS[c.op], pos, kw, tensors, consts, ["q", "k", "v"], reference,
                   lambda res, vals: {"out": res[0], "lse": res[1]}, shared_floor=True)


def _sequence_index(b: int, t: int, lens, device) -> torch.Tensor:
    """(B, T) sequence number of every token: the batch index, or the packed sequence of ``lens``."""
    if lens is None:
        return torch.arange(b, device=device)[:, None].expand(b, t)
    return torch.repeat_interleave(torch.arange(len(lens), device=device),
                                   torch.tensor(lens, device=device))[None, :]


def _plant_nan(g: torch.Tensor, seq: torch.Tensor, nan: int, gen: torch.Generator) -> None:
    """A NaN at one (token, head, channel) of sequence ``nan`` (g (B, T, H, D), seq (B, T))."""
    rows = (seq == nan).nonzero()
    if len(rows) == 0:
        return
    bi, ti = rows[int(torch.randint(len(rows), (1,), generator=gen))].tolist()
    h = int(torch.randint(g.shape[2], (1,), generator=gen))
    ch = int(torch.randint(g.shape[3], (1,), generator=gen))
    g[bi, ti, h, ch] = float("nan")


def _recurrent_problem(c: Case, device) -> Problem:
    """kda, kda_step, diag, diag_step."""
    p = c.p
    gen = torch.Generator().manual_seed(c.seed + 12345)
    dt = DTYPES[c.dtype]
    step = c.op.endswith("_step")
    consts: Dict[str, object] = {}
    if c.op in ("kda", "kda_step"):
        kc = p["kda"]
        xs, kwt = kda_inputs(kc, device)
        tensors = dict(zip(["q", "k", "v", "g", "beta"], xs))
        consts.update(scale=kc.scale, use_qk_l2norm=kc.l2)
        if "lower_bound" in kwt:
            consts["lower_bound"] = kwt.pop("lower_bound")
        tensors.update(kwt)
        b, t, lens = kc.B, kc.T, None if kc.cu is None else [y - x for x, y in zip(kc.cu, kc.cu[1:])]
        state_shape = (kc.HV, kc.K, kc.V)
        leaves = ["q", "k", "v", "g", "beta"] + [n for n in _GRAD_KW if n in tensors]
        names = ["q", "k", "v", "g", "beta"]
        if not step:
            consts["output_final_state"] = kc.final
    else:
        b, t, h, d = p["b"], p["t"], p["h"], p["d"]
        lens = None if step else p["lens"]
        gdt = torch.float32 if p["g32"] else dt
        qkv = [torch.randn(b, t, h, d, generator=gen).to(device=device, dtype=dt) for _ in range(3)]
        tensors = dict(q=qkv[0], k=qkv[1], v=qkv[2], g=_log_decay(gen, (b, t, h, d), p["decay"]).to(device, gdt))
        state_shape = (h, d)
        if not step:
            consts["output_final_state"] = p["final"]
            if p["h0"]:
                tensors["initial_state"] = torch.randn(b if lens is None else len(lens), h, d, generator=gen).to(device)
            if lens is not None:
                tensors["cu_seqlens"] = _cu(lens, getattr(torch, p["cu_dtype"])).to(device)
        leaves = ["q", "k", "v", "g"] + (["initial_state"] if "initial_state" in tensors else [])
        names = ["q", "k", "v", "g"]
    if "cu_seqlens" in tensors and tensors["cu_seqlens"].dtype != torch.int64 and c.seed % 3 == 0:
        tensors["cu_seqlens"] = tensors["cu_seqlens"].to(torch.int64)
    state_dt = torch.float64 if p.get("state64") else torch.float32
    if "initial_state" in tensors:
        tensors["initial_state"] = tensors["initial_state"].to(state_dt)
    seq = _sequence_index(b, t, lens, device)
    if c.nan is not None:
        g = tensors["g"].clone()
        _plant_nan(g, seq, c.nan, gen)
        tensors["g"] = g
    if step:
        tensors["state"] = (torch.randn((p["pool"],) + state_shape, generator=gen) * 0.5).to(device, state_dt)
        spec = p.get("spec")
        if spec is not None:
            tensors["state_indices"] = torch.tensor(spec["slots"], dtype=getattr(torch, p["indices"]),
                                                    device=device).view(b, t)
            if spec["accepted"] is not None:
                tensors["num_accepted_tokens"] = torch.tensor(spec["accepted"], dtype=torch.int32, device=device)
        elif p["indices"] is not None:
            tensors["state_indices"] = torch.tensor(p["perm"], dtype=getattr(torch, p["indices"]), device=device)
        names.append("state")
        leaves = [x for x in leaves if x not in _GRAD_KW]
    pos = names
    kw = [n for n in tensors if n not in names] + list(consts)
    fn = FUNCTIONS[c.op]
    is_kda = c.op.startswith("kda")

    def run_ref(vals, upcast, **extra):
        args = [vals[n] for n in ("q", "k", "v", "g", "beta")] if is_kda else [vals[n] for n in ("q", "k", "v", "g")]
        opts = {n: vals[n] for n in ("initial_state", "cu_seqlens", "A_log", "dt_bias", "lower_bound", "scale",
                                      "use_qk_l2norm", "output_final_state") if n in vals}
        opts.update(extra)
        return (ref.kda if is_kda else ref.gated_diag)(*args, upcast=upcast, **opts)

    if not step:
        def reference(vals, upcast):
            o, s = run_ref(vals, upcast)
            return {"o": o, "final_state": s} if s is not None else {"o": o}

        def outputs(res, vals):
            o, s = res
            return {"o": o, "final_state": s} if s is not None else {"o": o}
        n_seq = b if lens is None else len(lens)
        sequence_of = {"o": seq[:, :, None, None], "final_state": torch.arange(n_seq, device=device)}
        pools = ()
    else:
        def reference(vals, upcast):
            pool = vals["state"].clone()
            idx = vals.get("state_indices")
            idx = torch.arange(b, device=pool.device) if idx is None else idx.long()
            if idx.dim() == 1:
                o, s = run_ref(vals, upcast, initial_state=pool[idx], output_final_state=True)
                pool[idx] = s.to(pool.dtype)
                return {"o": o, "state": pool}
            # (B, T) slots: start from the last accepted token's slot, write the state after every token
            nat = vals.get("num_accepted_tokens")
            col = torch.zeros(b, dtype=torch.long, device=pool.device) if nat is None else nat.long() - 1
            s, outs = pool[idx.gather(1, col[:, None])[:, 0]], []
            for i in range(t):
                one = {n: (x[:, i:i + 1] if n in per_token else x) for n, x in vals.items()}
                o_i, s = run_ref(one, upcast, initial_state=s, output_final_state=True)
                pool[idx[:, i]] = s.to(pool.dtype)
                outs.append(o_i)
            return {"o": torch.cat(outs, 1), "state": pool}

        def outputs(res, vals):
            return {"o": res, "state": vals["state"]}
        per_token = ("q", "k", "v", "g", "beta")
        slot_seq = torch.full((p["pool"],), -1, dtype=torch.long, device=device)
        if spec is not None:              # slot -> the sequence whose row holds it
            slot_seq[torch.tensor(spec["slots"], device=device)] = torch.arange(b, device=device).repeat_interleave(t)
        else:
            slot_seq[torch.tensor(p["perm"] if p["indices"] is not None else list(range(b)), device=device)] = \
                torch.arange(b, device=device)
        sequence_of = {"o": seq[:, :, None, None], "state": slot_seq}
        pools = ("state",)
    return Problem(fn, pos, kw, tensors, consts, leaves, reference, outputs, sequence_of, pools)


def problem(c: Case, device) -> Problem:
    return _flash_problem(c, device) if c.op.startswith("flash") else _recurrent_problem(c, device)


# =============================================================================================
# running and checking
# =============================================================================================


def _expand(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sequence index (leading dims of ``like``) to the shape of ``like``."""
    return mask.reshape(tuple(mask.shape) + (1,) * (like.dim() - mask.dim())).expand_as(like)


def _interpreter_on() -> bool:
    return settings.triton_interpreter()


class Checker:
    """Runs one configuration on any backend against references computed once."""

    def __init__(self, case: Case, device="cpu"):
        self.case, self.device = case, torch.device(device)
        self.prob = problem(case, device)
        self._refs = None

    # ---- inputs
    def values(self, mode: str) -> Dict[str, object]:
        """The call's arguments: "run" (views as drawn, leaves requiring grad when the case checks gradients),
        "ref64" (contiguous float64 copies) or "low" (contiguous copies in the input dtype)."""
        c, prob = self.case, self.prob
        vals: Dict[str, object] = dict(prob.consts)
        for name, x in prob.tensors.items():
            if mode == "ref64" and x.is_floating_point():
                x = x.double()
            else:
                x = x.clone()
            if mode == "run" and name in c.strided:
                x = strided(x, c.strided[name])
            if c.grad and name in prob.leaves:
                x.requires_grad_(True)
            vals[name] = x
        if c.op == "flash_varlen" and c.p.get("same_cu"):
            vals["cu_seqlens_k"] = vals["cu_seqlens_q"]
        return vals

    def call_args(self, vals):
        return [vals[n] for n in self.prob.pos], {n: vals[n] for n in self.prob.kw}

    # ---- references
    def _evaluate(self, vals, run: Callable[[], object], seed: int):
        outs = run()
        grads = {}
        if self.case.grad:
            names = [n for n in outs if n != "lse"]
            leaves = [vals[n] for n in self.prob.leaves]
            want = self.output_dtypes()
            grads = dict(zip(["d" + n for n in self.prob.leaves],
                             _loss_grads([outs[n] for n in names], leaves, seed, [want[n] for n in names])))
        return outs, grads

    def references(self):
        """(outputs, gradients) of the reference in float64 and in the input dtype (the rule's baseline)."""
        if self._refs is None:
            self._refs = []
            for mode, upcast in (("ref64", True), ("low", False)):
                vals = self.values(mode)
                self._refs.append(self._evaluate(vals, lambda: self.prob.reference(vals, upcast), self.case.seed + 1))
        return self._refs

    # ---- one backend
    def runs(self, backend: str) -> bool:
        """Whether ``da.explain`` says ``backend`` runs this call."""
        args, kw = self.call_args(self.values("run"))
        return da.explain(self.prob.fn, *args, backend=backend, **kw).chosen is not None

    def check(self, backend: str) -> str:
        """'declared' (the backend says it cannot run the call, and refuses it with those reasons) or 'ran' (and
        every output and gradient passed the rule). Raises AssertionError with the configuration otherwise."""
        c, prob = self.case, self.prob
        vals = self.values("run")
        args, kw = self.call_args(vals)
        ex = da.explain(prob.fn, *args, backend=backend, **kw)
        if ex.chosen is None:
            self._check_refusal(backend, ex, args, kw)
            return "declared"
        if backend == "auto":
            self._check_auto_choice(ex, args, kw)
        try:
            with poison_outputs():
                outs, grads = self._evaluate(vals, lambda: prob.outputs(prob.fn(*args, backend=backend, **kw), vals),
                                             c.seed + 1)
        except UnsupportedError as e:
            raise AssertionError(f"explain said {ex.chosen!r} runs it, the call refused: {e}\n{c}") from e
        (o64, g64), (olo, glo) = self.references()
        bad = self._compare(outs, o64, olo, "fwd", None)
        if grads:
            floor = attention_grad_floor(list(g64.values()), DTYPES[c.dtype]) if prob.shared_floor else None
            bad += self._compare(grads, g64, glo, "grad", floor)
        bad += self._dtypes(outs)
        assert not bad, f"backend {backend!r} ({ex.chosen}) chose to run it but:\n  " + "\n  ".join(bad) + f"\n{c}"
        return "ran"

    def _check_refusal(self, backend, ex, args, kw):
        reasons = ex.considered[0][1] if backend != "auto" else [r for _, rs in ex.considered for r in rs]
        assert reasons, f"{backend}: no backend chosen and no reason given\n{ex}\n{self.case}"
        try:
            self.prob.fn(*args, backend=backend, **kw)
        except UnsupportedError as e:
            missing = [r for r in reasons if r not in str(e)]
            assert not missing, f"the refusal does not name {missing}: {e}\n{self.case}"
        else:
            raise AssertionError(f"explain says {backend!r} cannot run it ({reasons}), the call ran\n{self.case}")
        if backend != "auto":
            auto = da.explain(self.prob.fn, *args, **kw)
            assert auto.chosen != backend, (str(auto), reasons)
            auto_reasons = dict(auto.considered)[backend]
            if ex.call.features == auto.call.features:
                assert auto_reasons == reasons, (str(auto), reasons)
            else:   # a feature read from the values for an explicit call only (strong_decay, docs/DISPATCH.md)
                assert ex.call.features > auto.call.features and set(auto_reasons) < set(reasons), (str(auto), ex)

    def _check_auto_choice(self, ex, args, kw):
        """On CPU tensors, auto runs attention on SDPA's CPU kernel wherever it can, and never a Triton kernel the
        interpreter computes wrongly (bf16 tl.dot)."""
        reasons = dict(ex.considered)
        if self.device.type == "cpu" and self.case.op.startswith("flash") and not reasons["sdpa"]:
            assert ex.chosen == "sdpa", str(ex)
        if self.device.type == "cpu" and self.case.dtype == "bf16" and self.case.op in ("flash", "flash_varlen", "kda"):
            assert ex.chosen != "triton", str(ex)
            assert any("interpreter" in r for r in reasons["triton"]) or not _interpreter_on(), str(ex)

    def _compare(self, outs, r64, low, kind, floor) -> List[str]:
        bad = []
        if set(outs) != set(r64):
            return [f"outputs {sorted(outs)} != reference's {sorted(r64)}"]
        for name in outs:
            a, b, cc = outs[name], r64[name], low[name]
            if tuple(a.shape) != tuple(b.shape):
                bad.append(f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
                continue
            a, b, cc, nan_bad = self._mask_nan_sequence(name, a, b, cc)
            v = rule(a, b, cc, kind=kind, floor=floor, name=name)
            bad += nan_bad + ([] if v.ok else [v.message])
        return bad

    def _mask_nan_sequence(self, name, a, b, cc):
        """A planted NaN stays in its own sequence: where the reference is NaN the result must be NaN (a NaN gate
        is never a silent reset); the rest of that sequence is checked by the rule for the gated diagonal (whose
        channels are independent) and left out for KDA (its chunked form may spread the NaN inside the sequence).
        Every other sequence is checked by the rule."""
        if self.case.nan is None or name not in self.prob.sequence_of:
            return a, b, cc, []
        a, b, cc = (x.detach().to(torch.float64).cpu() for x in (a, b, cc))
        in_seq = _expand(self.prob.sequence_of[name].cpu() == self.case.nan, a)
        ref_nan = torch.isnan(b)
        bad = []
        if bool((ref_nan & ~torch.isnan(a)).any()):
            bad.append(f"{name}: {int((ref_nan & ~torch.isnan(a)).sum())} entries finite where the reference is "
                       f"NaN (a NaN gate must propagate in its sequence)")
        if bool((ref_nan & ~in_seq).any()):
            bad.append(f"{name}: the reference's NaN left its sequence (test defect)")
        hide = ref_nan | (in_seq if self.case.op.startswith("kda") else torch.zeros_like(in_seq))
        return (torch.where(hide, 0.0, a), torch.where(hide, 0.0, b), torch.where(hide, 0.0, cc), bad)

    def output_dtypes(self) -> Dict[str, torch.dtype]:
        """The dtype of every output as the backends must return it: o / out in the input dtype; states and lse
        float32 (float64 for float64 inputs); pools keep their dtype."""
        dt = DTYPES[self.case.dtype]
        wide = ref.accumulation_dtype(dt)
        want = {"out": dt, "o": dt, "lse": wide, "final_state": wide}
        want.update({n: self.prob.tensors[n].dtype for n in self.prob.pools})
        return want

    def _dtypes(self, outs) -> List[str]:
        want = self.output_dtypes()
        return [f"{n}: dtype {outs[n].dtype}, expected {want[n]}" + (" (the pool's)" if n in self.prob.pools else "")
                for n in outs if n in want and outs[n].dtype != want[n]]


# =============================================================================================
# hand-set configurations
# =============================================================================================


def edge(op: str, *, domain: str = "cpu", dtype: str, grad: bool = False, strided=None, nan=None, **p) -> Case:
    """A hand-set configuration: the first draw of ``op`` with ``p`` overriding its parameters (``kda`` takes
    KDACase fields as ``kda={...}``)."""
    base = draw(op, 0, domain)
    params = {k: v for k, v in base.p.items() if k != "spec"}       # (B, T) slots only when given
    if "kda" in p:
        params["kda"] = replace(params["kda"], dtype=dtype, grad=grad, **p.pop("kda"))
    params.update(p)
    return Case(op, 0, domain, dtype, grad, params, dict(strided or {}), nan)


