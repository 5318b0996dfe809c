"""dd.flash_attn_func / dd.flash_attn_varlen_func on CUDA with NCCL: one rank on one GPU (world size 1, in
this process) with backends triton and cudnn in bf16 / fp16, and 2 ranks (spawned, one GPU each) when two
GPUs are visible. Every rank's out, lse and gradients against the float64 reference with the DESIGN rule;
the cases of odd seed are given the batch's plan (``dd.prepare``)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import delta_attn.distributed as dd
from delta_attn import reference
from delta_attn.backends import package_available
from delta_attn.testing import assert_close
from distributed_harness import run_ranks
from pinned_tuning import pin_flash_tuning


def _check_case(*, varlen, layout, backend, dtype, kw, shapes, cu=None, seed=0, cu_k=None):
    """Full inputs on every rank (same seed), the op on this rank's shard, the reference on the full inputs.
    ``cu_k``: the keys' boundaries when they differ from ``cu`` (q and k sharded separately)."""
    cu_k = cu if cu_k is None else cu_k
    cu, cu_k = (None if c is None else c.cuda() for c in (cu, cu_k))
    kw = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(s, device="cuda", generator=g, dtype=torch.float32).to(dtype) for s in shapes)
    tdim = 0 if varlen else 1
    res = {}
    w_out = None
    for name, dt, up in (("64", torch.float64, True), ("low", dtype, False)):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        if varlen:
            o, l = reference.attention_varlen(*xs, cu, cu_k, upcast=up, **kw)
        else:
            o, l = reference.attention(*xs, upcast=up, **kw)
        if w_out is None:
            w_out = torch.randn(o.shape, device="cuda", generator=g, dtype=torch.float32)
        res[name] = (o, l, *torch.autograd.grad(o, xs, w_out.to(dt)))
    loc = [dd.shard(t, dim=tdim, layout=layout).requires_grad_() for t in (q, k, v)]
    extra = {}
    if seed % 2:                    # the batch's plan: built once, the call reads nothing on the host
        extra["plan"] = (dd.prepare(cu_seqlens=cu, cu_seqlens_k=cu_k, layout=layout) if varlen else
                         dd.prepare(seqlen=q.shape[1], seqlen_k=k.shape[1], layout=layout, device=q.device))
    if varlen:
        m, mk = int((cu[1:] - cu[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
        o, l, _ = dd.flash_attn_varlen_func(*loc, cu, cu_k, m, mk, return_attn_probs=True, shard_layout=layout,
                                            backend=backend, **kw, **extra)
    else:
        o, l, _ = dd.flash_attn_func(*loc, return_attn_probs=True, layout=layout, backend=backend, **kw, **extra)
    got = (o, l, *torch.autograd.grad(o, loc, dd.shard(w_out.to(dtype), dim=tdim, layout=layout)))
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        dim = -1 if name == "lse" else tdim
        want = [dd.shard(r[i].detach(), dim=dim, layout=layout) for r in res.values()]
        assert_close(got[i], want[0], want[1], kind="grad" if name.startswith("d") else "fwd",
                     name=f"rank {dist.get_rank()} {name} {backend} {dtype} {layout} varlen={varlen} {kw}")


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)     # moved by _check_case


def _alibi(h):
    return torch.rand(h, generator=torch.Generator().manual_seed(h)) * 0.3


# (varlen, layout, backend, dtype, options, shapes, cu): T = 2048 dense, 1536 packed, GQA 8 / 2
def _cases(world):
    t, tv = 1024 * world, 768 * world
    dense = ((2, t, 8, 128), (2, t, 2, 128), (2, t, 2, 128))
    packed = ((tv, 8, 64), (tv, 2, 64), (tv, 2, 64))
    cu = _cu([tv // 3 + 5, 0, tv - 2 * (tv // 3) - 5 - 1, tv // 3, 1])      # sequences span ranks, one empty
    return [
        (False, "zigzag", "triton", torch.bfloat16, dict(causal=True), dense, None),
        (False, "contiguous", "triton", torch.float16, dict(window_size=(300, 100), softcap=20.0), dense, None),
        (False, "zigzag", "triton", torch.bfloat16, dict(causal=True, alibi_slopes=_alibi(8)), dense, None),
        (True, "contiguous", "triton", torch.float16, dict(causal=True), packed, cu),
        (True, "zigzag", "triton", torch.bfloat16, dict(window_size=(200, 0)), packed, cu),
        (False, "contiguous", "cudnn", torch.bfloat16, dict(causal=True), dense, None),
        (True, "contiguous", "cudnn", torch.bfloat16, dict(causal=True), packed, cu),
        (True, "contiguous", "cudnn", torch.float16, dict(window_size=(128, 64)), packed, cu),
    ]


# cu_seqlens_k != cu_seqlens_q: 1536 packed queries, 2048 packed keys per rank count; (Sq, Sk) per sequence
# (tv/3 + 5, tk/4) Sq > Sk spanning ranks, (0, 7), (1, 0), (rest, rest) Sq < Sk
def _distinct_cases(world):
    tv, tk = 768 * world, 1024 * world
    packed = ((tv, 8, 64), (tk, 2, 64), (tk, 2, 64))
    cu_q = _cu([tv // 3 + 5, 0, 1, tv - tv // 3 - 6])
    cu_k = _cu([tk // 4, 7, 0, tk - tk // 4 - 7])
    return [
        ("contiguous", "triton", torch.float16, dict(causal=True), packed, cu_q, cu_k),
        ("zigzag", "triton", torch.bfloat16, dict(window_size=(200, 50)), packed, cu_q, cu_k),
        ("contiguous", "cudnn", torch.bfloat16, dict(causal=True), packed, cu_q, cu_k),
    ]


# dense Sq != Sk: q and k / v sharded separately (Sq = 1024 W, Sk = 1536 W, then Sq > Sk with rows before
# the diagonal that see no key); Triton only (cuDNN's causal with Sq != Sk needs cudnn-frontend graphs)
def _dense_distinct_cases(world):
    sq, sk = 1024 * world, 1536 * world
    return [
        ("zigzag", "triton", torch.bfloat16, dict(causal=True), ((2, sq, 8, 128), (2, sk, 2, 128), (2, sk, 2, 128))),
        ("contiguous", "triton", torch.float16, dict(window_size=(256, 64)),
         ((1, sk, 8, 64), (1, sq, 2, 64), (1, sq, 2, 64))),
    ]


def _checks(world):
    """(id, keyword arguments of _check_case) of every case at this world size."""
    out = []
    for i, (varlen, layout, backend, dtype, kw, shapes, cu) in enumerate(_cases(world)):
        if backend == "cudnn" and not varlen and (world > 1 or layout == "zigzag") and not package_available("cudnn"):
            continue        # causal with Sq != Sk (a rank's keys reach past its queries) needs cudnn-frontend graphs
        out.append((f"{'varlen' if varlen else 'dense'}-{i}-{backend}",
                    dict(varlen=varlen, layout=layout, backend=backend, dtype=dtype, kw=kw, shapes=shapes, cu=cu, seed=i)))
    for i, (layout, backend, dtype, kw, shapes, cu_q, cu_k) in enumerate(_distinct_cases(world)):
        out.append((f"varlen-distinct-{i}-{backend}", dict(varlen=True, layout=layout, backend=backend, dtype=dtype,
                                                           kw=kw, shapes=shapes, cu=cu_q, seed=100 + i, cu_k=cu_k)))
    for i, (layout, backend, dtype, kw, shapes) in enumerate(_dense_distinct_cases(world)):
        out.append((f"dense-distinct-{i}-{backend}", dict(varlen=False, layout=layout, backend=backend, dtype=dtype,
                                                          kw=kw, shapes=shapes, seed=200 + i)))
    return out


_ONE_RANK = _checks(1)


@pytest.fixture(scope="module")
def nccl_world_of_one():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 'pg')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("case", [kw for _, kw in _ONE_RANK], ids=[name for name, _ in _ONE_RANK])
def test_one_rank_nccl_matches_reference(nccl_world_of_one, case, monkeypatch):
    """One case per test (they spread over xdist workers); the Triton flash kernels run one tuning entry each, in
    rotation, as in the property suite (autotuning every case's kernels took over 400 s)."""
    pin_flash_tuning(monkeypatch, case["seed"])
    _check_case(**case)


def _body(rank, world):
    for _, case in _checks(world):
        _check_case(**case)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_nccl_match_reference():
    run_ranks(2, _body, backend="nccl", timeout=600, start="spawn")
