"""dd.flash_attn_func / dd.flash_attn_varlen_func on 2 and 3 gloo ranks (one spawn per world size).

Inside the workers, seeded random cases: every rank builds the same full inputs, runs the distributed op on
its shard and compares out, lse and every gradient with the single-process operator on the full inputs,
sharded the same way. float64 with backend="torch" (equal up to rounding), and a few tiny fp32 / fp16
cases with backend="triton" under the interpreter against the float64 reference with the DESIGN error rule.
Sq != Sk: dense (q and k / v sharded separately; each of these calls was refused when the dense function
needed Sq == Sk) and varlen with cu_seqlens_k != cu_seqlens_q.
"""
import random

import pytest
import torch

import delta_attn as da
import delta_attn.distributed as dd
from delta_attn import reference
from delta_attn.testing import assert_close

from distributed_harness import run_ranks

WINDOWS = [(-1, -1), (3, -1), (-1, 2), (2, 1), (0, 0), (5, 3), (1, 0)]


def _full(gen, shape, dtype):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _options(rnd, hq, batch):
    kw = dict(causal=rnd.random() < 0.5, window_size=rnd.choice(WINDOWS))
    if rnd.random() < 0.3:
        kw["softcap"] = 1.5
    if rnd.random() < 0.2:
        kw["softmax_scale"] = 0.7
    r = rnd.random()
    if r < 0.35:
        kw["alibi_slopes"] = torch.rand((hq,) if r < 0.2 else (batch, hq), generator=torch.Generator().manual_seed(
            rnd.randrange(1 << 30)), dtype=torch.float32) * 0.6
    return kw


def _loss(out, lse, w_out, w_lse):
    lse = lse.double()
    return (out.double() * w_out).sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).mul(w_lse).sum()


def _compare(got, want, what, tol):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _run_case(rank, world, *, varlen, layout, backend, dtype, kw, q, k, v, cu=None, tensor_layout="thd", cu_k=None):
    """Distributed vs single-process on the same full inputs; returns nothing, asserts everything.
    ``cu_k``: the keys' boundaries when they differ from ``cu`` (the queries')."""
    tdim = 1 if not varlen else (0 if tensor_layout == "thd" else 1)
    if varlen:
        cu_k = cu if cu_k is None else cu_k
        max_q, max_k = int((cu[1:] - cu[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    gen = torch.Generator().manual_seed(1234)
    # single process on the full inputs (float64, backend torch) and, for low precision, the rule's baseline
    refs = {}
    for name, dt, up in (("64", torch.float64, True), ("low", dtype, False)) if dtype != torch.float64 else (
            ("64", torch.float64, True),):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        if name == "64":
            if varlen:
                o, l, _ = da.flash_attn_varlen_func(*xs, cu, cu_k, max_q, max_k, return_attn_probs=True,
                                                    layout=tensor_layout, backend="torch", **kw)
            else:
                o, l, _ = da.flash_attn_func(*xs, return_attn_probs=True, backend="torch", **kw)
        else:
            rkw = {n: kw[n] for n in kw if n != "deterministic"}
            if varlen:
                o, l = reference.attention_varlen(*xs, cu, cu_k, layout=tensor_layout, upcast=False, **rkw)
            else:
                o, l = reference.attention(*xs, upcast=False, **rkw)
        w_out = torch.randn(o.shape, generator=gen, dtype=torch.float64)
        w_lse = torch.randn(l.shape, generator=gen, dtype=torch.float64)
        gen.manual_seed(1234)
        refs[name] = (o, l, *torch.autograd.grad(_loss(o, l, w_out, w_lse), xs))
    # distributed on this rank's shards
    shard = dict(dim=tdim, layout=layout)
    loc = [dd.shard(t.detach(), **shard).requires_grad_() for t in (q, k, v)]
    if varlen:
        o, l, _ = dd.flash_attn_varlen_func(*loc, cu, cu_k, max_q, max_k, return_attn_probs=True,
                                            shard_layout=layout, layout=tensor_layout, backend=backend, **kw)
    else:
        o, l, _ = dd.flash_attn_func(*loc, return_attn_probs=True, layout=layout, backend=backend, **kw)
    w_out = dd.shard(torch.randn(refs["64"][0].shape, generator=gen, dtype=torch.float64), **shard)
    w_lse = dd.shard(torch.randn(refs["64"][1].shape, generator=gen, dtype=torch.float64), dim=-1, layout=layout)
    got = (o, l, *torch.autograd.grad(_loss(o, l, w_out, w_lse), loc))
    names = ("out", "lse", "dq", "dk", "dv")
    for i, name in enumerate(names):
        dim = -1 if name == "lse" else tdim
        want = [dd.shard(r[i].detach(), dim=dim, layout=layout) for r in refs.values()]
        what = f"rank {rank}/{world} {name} varlen={varlen} layout={layout} backend={backend} {dtype} {kw}"
        if dtype == torch.float64:
            _compare(got[i], want[0], what, 1e-9)
        else:
            assert_close(got[i], want[0], want[1], kind="grad" if name.startswith("d") else "fwd", name=what)


def _random_cu(rnd, total):
    """Sequence boundaries over ``total`` packed tokens, with empty sequences and sequences spanning ranks."""
    cuts = sorted(rnd.randrange(0, total + 1) for _ in range(rnd.randint(0, 4)))
    cu = [0] + cuts + [total]
    if rnd.random() < 0.5:
        cu.insert(rnd.randrange(1, len(cu)), cu[rnd.randrange(len(cu))])   # an empty sequence somewhere
        cu = sorted(cu)
    return torch.tensor(cu, dtype=torch.int64 if rnd.random() < 0.5 else torch.int32)


def _body(rank, world, n_dense, n_varlen, triton_cases):
    torch.set_default_dtype(torch.float64)
    rnd = random.Random(world)
    gen = torch.Generator()
    # float64, backend torch: ALiBi past the diagonal (two calls merged by LSE), dense and varlen
    slopes = torch.tensor([[0.5, 0.2], [0.3, 0.7]], dtype=torch.float32)
    for layout, window in (("contiguous", (-1, -1)), ("zigzag", (3, 2))):
        gen.manual_seed(11)
        q, k, v = (_full(gen, (2, 4 * world, 2, 8), torch.float64) for _ in range(3))
        _run_case(rank, world, varlen=False, layout=layout, backend="torch", dtype=torch.float64,
                  kw=dict(alibi_slopes=slopes, window_size=window, softcap=1.5), q=q, k=k, v=v)
        cu = torch.tensor([0, 3, 4 * world - 1, 4 * world], dtype=torch.int32)    # the middle one spans ranks
        q, k, v = (_full(gen, (4 * world, 2, 8), torch.float64) for _ in range(3))
        _run_case(rank, world, varlen=True, layout=layout, backend="torch", dtype=torch.float64,
                  kw=dict(alibi_slopes=torch.tensor([0.4, 0.9, 0.1], dtype=torch.float32)[:, None].expand(3, 2)
                          .contiguous(), window_size=window), q=q, k=k, v=v, cu=cu)
    # float64, backend torch: random dense cases
    for _ in range(n_dense):
        layout = rnd.choice(dd.LAYOUTS)
        b, hk, ratio, d = rnd.choice([1, 2]), rnd.choice([1, 2]), rnd.choice([1, 2, 4]), rnd.choice([4, 8])
        dv = rnd.choice([d, d + 4])
        t_local = rnd.choice([2, 4, 6]) if layout == "zigzag" else rnd.choice([1, 3, 5])
        hq, t = hk * ratio, t_local * world
        gen.manual_seed(rnd.randrange(1 << 30))
        q, k, v = (_full(gen, s, torch.float64) for s in ((b, t, hq, d), (b, t, hk, d), (b, t, hk, dv)))
        _run_case(rank, world, varlen=False, layout=layout, backend="torch", dtype=torch.float64,
                  kw=_options(rnd, hq, b), q=q, k=k, v=v)
    # float64, backend torch: random packed batches, sequences spanning ranks, empty sequences
    for _ in range(n_varlen):
        layout = rnd.choice(dd.LAYOUTS)
        tl = rnd.choice(["thd", "htd"])
        hk, ratio, d = rnd.choice([1, 2]), rnd.choice([1, 2]), 4
        t_local = rnd.choice([2, 4, 6]) if layout == "zigzag" else rnd.choice([1, 3, 4])
        hq, total = hk * ratio, t_local * world
        cu = _random_cu(rnd, total)
        gen.manual_seed(rnd.randrange(1 << 30))
        shapes = ((total, hq, d), (total, hk, d), (total, hk, d + 2))
        q, k, v = (_full(gen, s if tl == "thd" else (s[1], s[0], s[2]), torch.float64) for s in shapes)
        _run_case(rank, world, varlen=True, layout=layout, backend="torch", dtype=torch.float64,
                  kw=_options(rnd, hq, cu.numel() - 1), q=q, k=k, v=v, cu=cu, tensor_layout=tl)
    # backend triton under the interpreter: tiny fp32 / fp16 cases, one option set each
    for dtype, varlen, layout, kw in triton_cases:
        gen.manual_seed(7)
        if varlen:
            total = 4 * world
            cu = torch.tensor([0, 3, 3, total - 2, total], dtype=torch.int32)
            q, k, v = (_full(gen, s, dtype) for s in ((total, 2, 16), (total, 1, 16), (total, 1, 16)))
        else:
            cu = None
            q, k, v = (_full(gen, s, dtype) for s in ((1, 4 * world, 2, 16), (1, 4 * world, 1, 16),
                                                      (1, 4 * world, 1, 16)))
        _run_case(rank, world, varlen=varlen, layout=layout, backend="triton", dtype=dtype, kw=kw, q=q, k=k, v=v,
                  cu=cu)
    _validation(rank, world)


def _validation(rank, world):
    q = torch.zeros(1, 2, 2, 8)
    with pytest.raises(ValueError, match="layout"):
        dd.flash_attn_func(q, q, q, layout="ring")
    with pytest.raises(ValueError, match="q local sequence length"):
        dd.flash_attn_func(q[:, :0], q, q)
    with pytest.raises(ValueError, match="k local sequence length"):
        dd.flash_attn_func(q, q[:, :0], q[:, :0])
    with pytest.raises(ValueError, match="2 x world size"):
        dd.flash_attn_func(q[:, :1], q[:, :1], q[:, :1], layout="zigzag")
    with pytest.raises(ValueError, match="global key length Sk .*2 x world size"):
        dd.flash_attn_func(q, q[:, :1], q[:, :1], layout="zigzag")
    with pytest.raises(ValueError, match="sequence length"):           # k and v of different lengths
        dd.flash_attn_func(q, q, q[:, :1])
    with pytest.raises(TypeError, match="group"):
        dd.flash_attn_func(q, q, q, group="world")
    with pytest.raises(ValueError, match="dropout_p"):
        dd.flash_attn_func(q, q, q, dropout_p=0.1)
    x = torch.zeros(3, 2, 8)
    cu = torch.tensor([0, 3 * world], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        dd.flash_attn_varlen_func(x, x, x, torch.tensor([0, 3], dtype=torch.int32), cu, 3 * world, 3 * world)
    with pytest.raises(ValueError, match="cu_seqlens_k"):       # cu_seqlens_k[-1] != W x the local keys
        dd.flash_attn_varlen_func(x, x, x, cu, torch.tensor([0, 3 * world + 1], dtype=torch.int32), 3 * world,
                                  3 * world + 1)
    with pytest.raises(ValueError, match="more queries than keys"):
        _alibi_refused(world)
    with pytest.raises(ValueError, match="alibi_slopes.*more queries than keys"):     # dense: the same refusal
        dd.flash_attn_func(torch.zeros(1, 3, 2, 8), q[:, :1], q[:, :1], alibi_slopes=torch.ones(2, dtype=torch.float32))
    with pytest.raises(ValueError, match="shard_layout"):
        dd.flash_attn_varlen_func(x, x, x, cu, cu, 3 * world, 3 * world, shard_layout="ring")


def _alibi_refused(world):
    """ALiBi past the diagonal in a sequence with Sq >= Sk + 2 cut by a q shard boundary: refused on every rank."""
    q, kv = torch.zeros(3, 2, 8), torch.zeros(1, 2, 8)
    cu_q, cu_k = (torch.tensor([0, n * world], dtype=torch.int32) for n in (3, 1))
    dd.flash_attn_varlen_func(q, kv, kv, cu_q, cu_k, 3 * world, world,
                              alibi_slopes=torch.ones(2, dtype=torch.float32))


TRITON_CASES = [
    (torch.float16, True, "contiguous", dict(causal=True, alibi_slopes=torch.tensor([0.3, 0.1]))),
    (torch.float16, False, "zigzag", dict(causal=True)),
    (torch.float16, False, "contiguous", dict(window_size=(3, 2), softcap=2.0)),
    # ALiBi with keys after the queries: two calls merged by their LSE, gradients through the Triton LSE
    (torch.float16, False, "zigzag", dict(alibi_slopes=torch.tensor([0.3, 0.1]))),
    (torch.float16, True, "contiguous", dict(window_size=(2, 3), alibi_slopes=torch.tensor([0.2, 0.5]))),
]


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_attention_matches_single_process(world):
    pytest.importorskip("triton")
    # world 3 runs 3 processes on CI's 2 cores: fewer cases, Triton (interpreter) cases on 2 ranks only
    if world == 2:
        run_ranks(world, _body, 20, 20, TRITON_CASES)
    else:
        run_ranks(world, _body, 10, 10, [])


# ---------------------------------------------------------------------------------------------
# cu_seqlens_k != cu_seqlens_q: q and k sharded separately (each an equal share of its packed tokens)
# ---------------------------------------------------------------------------------------------


def _fixed_cu_pair(world):
    """Sequences: (Sq, Sk) = (0, 2), (1, 0), (2W + 1, W) spanning ranks, (1, 1), (2W - 3, 5W - 3)."""
    w = world
    return (torch.tensor([0, 0, 1, 2 * w + 2, 2 * w + 3, 4 * w], dtype=torch.int32),
            torch.tensor([0, 2, 2, w + 2, w + 3, 6 * w], dtype=torch.int64))


def _qkv_distinct(gen, tl, total_q, total_k, hq, hk, d, dv, dtype):
    shapes = ((total_q, hq, d), (total_k, hk, d), (total_k, hk, dv))
    return [_full(gen, sh if tl == "thd" else (sh[1], sh[0], sh[2]), dtype) for sh in shapes]


def _body_distinct(rank, world, n_random, triton_cases, n_dense, dense_triton):
    torch.set_default_dtype(torch.float64)
    rnd = random.Random(100 + world)
    gen = torch.Generator()
    _dense_distinct(rank, world, random.Random(200 + world), gen, n_dense, dense_triton)
    cu_q, cu_k = _fixed_cu_pair(world)
    fixed = [("contiguous", "thd", dict(causal=True)), ("zigzag", "htd", dict(window_size=(2, 1))),
             ("contiguous", "thd", dict(window_size=(-1, 3), softcap=1.5)),
             ("zigzag", "thd", dict(causal=True, alibi_slopes=torch.tensor([0.4, 0.9], dtype=torch.float32))),
             ("contiguous", "htd", dict(window_size=(1, 0), alibi_slopes=torch.rand(5, 2, generator=gen,
                                                                            dtype=torch.float32)))]
    for layout, tl, kw in fixed:            # float64, backend torch, GQA 2:1
        gen.manual_seed(5)
        q, k, v = _qkv_distinct(gen, tl, 4 * world, 6 * world, 2, 1, 8, 6, torch.float64)
        _run_case(rank, world, varlen=True, layout=layout, backend="torch", dtype=torch.float64, kw=kw, q=q, k=k,
                  v=v, cu=cu_q, cu_k=cu_k, tensor_layout=tl)
    # rank 0's rows see no key at all (Sk = 0, then causal rows before the diagonal): its out carries no graph
    gen.manual_seed(6)
    q, k, v = _qkv_distinct(gen, "thd", 4 * world, 2 * world, 2, 2, 4, 4, torch.float64)
    _run_case(rank, world, varlen=True, layout="contiguous", backend="torch", dtype=torch.float64,
              kw=dict(causal=True), q=q, k=k, v=v, cu=torch.tensor([0, 2, 4 * world], dtype=torch.int32),
              cu_k=torch.tensor([0, 0, 2 * world], dtype=torch.int32))
    run = 0
    for _ in range(n_random):                # float64, backend torch: random boundaries and options
        layout, tl = rnd.choice(dd.LAYOUTS), rnd.choice(["thd", "htd"])
        tq, tk = ((rnd.choice([2, 4]), rnd.choice([2, 4, 6])) if layout == "zigzag"
                  else (rnd.randint(1, 4), rnd.randint(1, 5)))
        hk, ratio = rnd.choice([1, 2]), rnd.choice([1, 2])
        cq, ck = (torch.tensor(c, dtype=torch.int32) for c in _random_cu_pair(rnd, tq * world, tk * world))
        kw = _options(rnd, hk * ratio, cq.numel() - 1)
        gen.manual_seed(rnd.randrange(1 << 30))
        q, k, v = _qkv_distinct(gen, tl, tq * world, tk * world, hk * ratio, hk, 4, 6, torch.float64)
        try:
            _run_case(rank, world, varlen=True, layout=layout, backend="torch", dtype=torch.float64, kw=kw, q=q,
                      k=k, v=v, cu=cq, cu_k=ck, tensor_layout=tl)
            run += 1
        except ValueError as e:             # the documented ALiBi refusal (raised on every rank alike)
            assert "more queries than keys" in str(e), e
    assert run >= n_random // 2, f"only {run} of {n_random} random cases ran"
    for layout, kw, sq_gt_sk in triton_cases:          # backend triton under the interpreter, fp16
        gen.manual_seed(9)
        q, k, v = _qkv_distinct(gen, "thd", 4 * world, 6 * world, 2, 1, 16, 16, torch.float16)
        cq, ck = (cu_q, cu_k) if sq_gt_sk else _sq_lt_sk_cu_pair(world)
        _run_case(rank, world, varlen=True, layout=layout, backend="triton", dtype=torch.float16, kw=kw, q=q, k=k,
                  v=v, cu=cq, cu_k=ck)


# dense Sq != Sk: q sharded over Sq = W x tq, k and v over Sk = W x tk, each by the layout; (layout, tq, tk, kw)
# float64 / backend torch, GQA 2:1
DENSE_DISTINCT = [
    ("contiguous", 2, 5, dict(causal=True)),                        # Sq < Sk
    ("zigzag", 6, 2, dict(causal=True)),                            # Sq > Sk: rows before the diagonal see no key
    ("contiguous", 3, 1, dict(window_size=(2, 1))),                 # whole ranks without keys
    ("zigzag", 2, 4, dict(softcap=1.5, softmax_scale=0.7)),         # not causal
    ("contiguous", 1, 3, dict(window_size=(1, 2), alibi_slopes=torch.tensor([[0.5, 0.2], [0.3, 0.7]]))),  # merge
    ("zigzag", 4, 2, dict(causal=True, alibi_slopes=torch.tensor([0.4, 0.9]))),
    ("contiguous", 4, 1, dict(window_size=(1, 1), alibi_slopes=torch.tensor([0.4, 0.9]))),  # Sq > Sk, no split
]

# backend triton under the interpreter, fp16, world 2: (layout, tq, tk, kw); B 1, Hq 2, Hk 1, D 16
DENSE_DISTINCT_TRITON = [
    ("contiguous", 2, 6, dict(causal=True)),
    ("zigzag", 6, 2, dict(window_size=(3, 1))),
    ("zigzag", 2, 4, dict(alibi_slopes=torch.tensor([0.3, 0.1]))),    # Sq < Sk, ALiBi merges by LSE
]


def _dense_distinct(rank, world, rnd, gen, n_random, triton):
    """dd.flash_attn_func with Sq != Sk against da.flash_attn_func on the full inputs."""
    def case(layout, tq, tk, kw, b, hq, hk, d, dv, dtype, backend):
        q, k, v = (_full(gen, sh, dtype) for sh in ((b, tq * world, hq, d), (b, tk * world, hk, d),
                                                     (b, tk * world, hk, dv)))
        _run_case(rank, world, varlen=False, layout=layout, backend=backend, dtype=dtype, kw=kw, q=q, k=k, v=v)

    for i, (layout, tq, tk, kw) in enumerate(DENSE_DISTINCT):
        gen.manual_seed(20 + i)
        case(layout, tq, tk, kw, 2, 2, 1, 8, 6, torch.float64, "torch")
    run = 0
    for _ in range(n_random):               # random lengths, layouts, options, GQA ratios
        layout = rnd.choice(dd.LAYOUTS)
        tq, tk = rnd.sample([2, 4, 6] if layout == "zigzag" else [1, 2, 3, 5], 2)
        hk, ratio, b = rnd.choice([1, 2]), rnd.choice([1, 2, 4]), rnd.choice([1, 2])
        kw = _options(rnd, hk * ratio, b)
        gen.manual_seed(rnd.randrange(1 << 30))
        try:
            case(layout, tq, tk, kw, b, hk * ratio, hk, 4, rnd.choice([4, 6]), torch.float64, "torch")
            run += 1
        except ValueError as e:             # the documented ALiBi refusal (raised on every rank alike)
            assert "more queries than keys" in str(e), e
    assert run >= n_random // 2, f"only {run} of {n_random} random dense cases ran"
    for i, (layout, tq, tk, kw) in enumerate(triton):
        gen.manual_seed(30 + i)
        case(layout, tq, tk, kw, 1, 2, 1, 16, 16, torch.float16, "triton")


def _sq_lt_sk_cu_pair(world):
    """(Sq, Sk) = (0, 2), (1, 0), (3W - 1, 4W - 2) spanning ranks, (W, 2W): ALiBi past the diagonal may split."""
    w = world
    return (torch.tensor([0, 0, 1, 3 * w, 4 * w], dtype=torch.int32),
            torch.tensor([0, 2, 2, 4 * w, 6 * w], dtype=torch.int32))


DISTINCT_TRITON_CASES = [
    ("contiguous", dict(causal=True), True),
    ("zigzag", dict(window_size=(2, 1), alibi_slopes=torch.tensor([0.3, 0.1])), False),    # ALiBi merges by LSE
]


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_distinct_q_k(world):
    """Sq != Sk: dense (q and k sharded separately) and varlen (cu_seqlens_k != cu_seqlens_q)."""
    pytest.importorskip("triton")
    if world == 2:
        run_ranks(world, _body_distinct, 12, DISTINCT_TRITON_CASES, 12, DENSE_DISTINCT_TRITON)
    else:
        run_ranks(world, _body_distinct, 6, [], 6, [])


# ---------------------------------------------------------------------------------------------
# the planner on its own (no processes): the calls of all ranks cover exactly the global mask, each
# visible pair once, and the op's ALiBi distance of every call is the global one (reversed: one short)
# ---------------------------------------------------------------------------------------------


def _visible(i, j, lq, lk, window):
    wl, wr = window
    diag = i + lk - lq
    return (wl < 0 or j >= diag - wl) and (wr < 0 or j <= diag + wr), abs(diag - j)


def _pairs_of(call, pos):
    """{(global row, global key): op distance + correction} of one call (packed coordinates)."""
    r0, r1 = call.rows
    k0, k1 = call.keys
    cu_q, cu_k = call.cu if call.cu is not None else ((0, r1 - r0), (0, k1 - k0))
    out = {}
    for (qa, qb), (ka, kb) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
        lq, lk = qb - qa, kb - ka
        for i in range(lq):
            for j in range(lk):
                ii, jj = (lq - 1 - i, lk - 1 - j) if call.reversed else (i, j)
                ok, dist = _visible(ii, jj, lq, lk, call.window)
                if ok:
                    key = (int(pos[r0 + qa + i]), k0 + ka + j)
                    assert key not in out, f"pair {key} computed twice by {call}"
                    out[key] = dist + (1 if call.reversed else 0)
    return out


def _random_cu_pair(rnd, total_q, total_k):
    """Distinct q / k boundaries with as many sequences: lengths 0 and 1, Sq > Sk and Sq < Sk."""
    cu_q = _random_cu(rnd, total_q).tolist()
    n = len(cu_q) - 1
    cuts = sorted(rnd.randrange(0, total_k + 1) for _ in range(n - 1))
    return cu_q, [0] + cuts + [total_k]


def _plan_case(rnd, world, layout, window, alibi, varlen, distinct):
    """(global mask {(q, k): ALiBi distance}, {rank: (chunks, positions, blocks)}) of one random case."""
    from delta_attn.distributed import attention as A
    t_local = rnd.choice([2, 4, 6]) if layout == "zigzag" else rnd.randint(1, 6)
    tk_local = (rnd.choice([2, 4, 6]) if layout == "zigzag" else rnd.randint(1, 6)) if distinct else t_local
    total, total_k = world * t_local, world * tk_local
    if not varlen:                          # dense: one sequence of total queries and total_k keys
        cu, cu_k = [0, total], [0, total_k]
    elif distinct:
        cu, cu_k = _random_cu_pair(rnd, total, total_k)
    else:
        cu = cu_k = _random_cu(rnd, total).tolist()
    want = {}
    for (a, b), (ka, kb) in zip(zip(cu, cu[1:]), zip(cu_k, cu_k[1:])):
        for i in range(b - a):
            for j in range(kb - ka):
                ok, dist = _visible(i, j, b - a, kb - ka, window)
                if ok:
                    want[(a + i, ka + j)] = dist
    plans = {}
    for rank in range(world):
        chunks = dd.chunk_ranges(t_local, rank, world, layout)
        pos = dd.positions(t_local, rank, world, layout)
        blocks = (A.plan_varlen(chunks, cu, cu_k, window, alibi) if varlen
                  else A.plan_dense(chunks, total, total_k, window, alibi))
        plans[rank] = (t_local, pos, blocks)
    return want, plans, (world, layout, t_local, window, cu, cu_k)


@pytest.mark.parametrize("seed", range(6))
def test_plan_covers_the_global_mask_exactly(seed):
    rnd = random.Random(seed)
    refused = 0
    for _ in range(60):
        world, layout = rnd.choice([1, 2, 3, 4]), rnd.choice(dd.LAYOUTS)
        window = rnd.choice(WINDOWS + [(-1, 0)])
        alibi = rnd.random() < 0.5
        varlen = rnd.random() < 0.5
        distinct = rnd.random() < 0.5
        try:
            want, plans, case = _plan_case(rnd, world, layout, window, alibi, varlen, distinct)
        except ValueError as e:      # documented refusal: ALiBi split inside a sequence with Sq >= Sk + 2
            assert distinct and alibi and window[1] != 0 and "more queries than keys" in str(e), e
            refused += 1
            continue
        got = {}
        for t_local, pos, blocks in plans.values():
            rows = [r for blk in blocks for r in range(blk[0].rows[0], blk[0].rows[1])]
            assert rows == list(range(t_local)), "row blocks must tile the local rows in order"
            for blk in blocks:
                assert len(blk) == 1 or alibi, "only ALiBi splits a row block"
                for call in blk:
                    assert call.rows == blk[0].rows
                    assert min(call.window) >= -1
                    pairs = _pairs_of(call, pos)
                    assert not set(pairs) & set(got), "a pair is computed by two calls"
                    got.update(pairs)
        assert set(got) == set(want), (case, set(got) ^ set(want))
        if alibi:
            assert got == want, "the op's ALiBi distance must be the global one"
    assert refused < 30
