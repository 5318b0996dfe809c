"""dd.kda / dd.gated_diag_attn (state passing) on 2 and 3 gloo ranks against the single-process operator.

One spawn per world size runs every case: float64 with backend="torch" (outputs, final states and every
gradient equal the single-process op), and backend="triton" under the interpreter (fp32, K = 16, V = 16 or
32, shards of 4 to 70 tokens: carried pieces of one and of two 64-token chunks) within the error rule
(docs/TESTING.md) against the float64 reference, with the fp32 reference and with the single-process Triton
operator (a tenth of the rule's floor) as baselines, with gradients and without (KDA's inference pipeline).
Cases draw dense and packed (varlen) batches whose sequences span ranks, start or end on a shard boundary, or
are empty; GVA, l2 norm, the in-kernel gates, scale, with and without initial / final state; both
state-passing schemes; KDA's two-launch path of the widened local pass (a backend that refuses V + K value
columns) forced on some torch cases.
"""
import random

import pytest
import torch

from distributed_harness import run_ranks, saved_bytes
from sharded_grads import grad_names, loss_weights, sharded, single_process

TORCH_CASES = 14          # per operator and world size
TRITON_CASES = {"kda": 6, "diag": 2}   # per world size, dense and packed (fp32 under the interpreter)


def _TIGHT(ref64):
    """The floor against the single-process Triton operator (fp32, IEEE dots: both within ~1e-7 of float64):
    a tenth of the error rule's default, so a context-parallel path that loses accuracy fails."""
    return 1e-6 * max(1.0, float(ref64.abs().max()))


def _cu(r: random.Random, total: int, t_local: int):
    """Packed lengths summing to ``total``: cuts anywhere, on shard boundaries, repeated (empty sequences)."""
    cuts = {r.randint(0, total) for _ in range(r.randint(0, 4))}
    if r.random() < 0.5:
        cuts.add(t_local * r.randint(1, total // t_local))
    cuts = sorted(cuts | {0, total})
    if r.random() < 0.4:                              # an empty sequence somewhere
        cuts.insert(r.randrange(len(cuts)), cuts[r.randrange(len(cuts))])
        cuts.sort()
    return cuts


def _case(seed: int, op: str, world: int, triton: bool):
    r = random.Random(seed * 7919 + world)
    dt = torch.float32 if triton else torch.float64
    varlen = r.random() < 0.5
    # Triton: pieces of one and of several 64-token chunks (the training pipeline's), so the carried rows'
    # transition runs over more than one chunk
    t_local = r.choice([1, 3, 5]) if not triton else r.choice([4, 37, 70])
    total = world * t_local
    b = 1 if varlen else r.randint(1, 2)
    cu = _cu(r, total, t_local) if varlen else None
    n = len(cu) - 1 if varlen else b
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)   # noqa: E731
    kw = dict(output_final_state=r.random() < 0.7)
    if op == "kda":
        h = 1 if triton else r.choice([1, 2])
        hv = h * r.choice([1, 2])
        kd, vd = (16, r.choice([16, 32])) if triton else (r.choice([3, 4]), r.choice([2, 5]))
        l2 = r.random() < 0.4
        q, k = rnd(b, total, h, kd), rnd(b, total, h, kd) * (1.0 if l2 else kd ** -0.5)
        v = rnd(b, total, hv, vd)
        gate = r.choice([None, None, "softplus", "lower_bound"])
        if gate is None:
            g = torch.nn.functional.logsigmoid(rnd(b, total, hv, kd) + 2.0)
        else:
            g = rnd(b, total, hv, kd)
            kw["A_log"] = rnd(hv) * 0.5
            kw["dt_bias"] = rnd(hv * kd) * 0.5
            if gate == "lower_bound":
                kw["lower_bound"] = -5.0
        beta = torch.rand(b, total, hv, generator=gen, dtype=torch.float64)
        xs = [q, k, v, g, beta]
        kw["use_qk_l2norm"] = l2
        if r.random() < 0.3:
            kw["scale"] = 0.3
        state = (hv, kd, vd)
    else:
        h, d = (1, 16) if triton else (r.choice([1, 3]), r.choice([2, 16]))
        xs = [rnd(b, total, h, d) for _ in range(3)] + [torch.nn.functional.logsigmoid(rnd(b, total, h, d) + 2.0)]
        state = (h, d)
    if r.random() < 0.6:
        kw["initial_state"] = rnd(n, *state) * 0.5
    if varlen:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    xs = [x.to(dt) for x in xs]
    kw = {key: (t.to(dt) if torch.is_tensor(t) and t.is_floating_point() and key != "initial_state" else t)
          for key, t in kw.items()}
    if "initial_state" in kw:
        kw["initial_state"] = kw["initial_state"].to(torch.float64 if not triton else torch.float32)
    split = op == "kda" and r.random() < 0.3
    return xs, kw, r.choice(["allgather", "ring"]), split


def _body(rank, world, ops, torch_cases, triton_cases):
    import delta_attn as da
    import delta_attn.distributed as dd
    from delta_attn import reference
    from delta_attn.distributed import linear
    from delta_attn.testing import check
    single = {"kda": da.kda, "diag": da.gated_diag_attn}
    ref = {"kda": reference.kda, "diag": reference.gated_diag}
    context_parallel = {"kda": dd.kda, "diag": dd.gated_diag_attn}
    fuse_ok = linear._KDA.fuse_ok
    for op in ops:
        for seed in range(torch_cases + triton_cases[op]):
            triton = seed >= torch_cases
            xs, kw, sp, split = _case(seed, op, world, triton)
            linear._KDA.fuse_ok = (lambda *a: False) if split else fuse_ok
            tag = f"{op} seed {seed} world {world} {'triton' if triton else 'torch'} {sp} split={split} " \
                  f"cu={kw.get('cu_seqlens', torch.tensor([])).tolist()} shape={tuple(xs[0].shape)}"
            fo, ff = xs[-1].shape[:2] + xs[2].shape[2:], None
            if kw["output_final_state"]:
                n = len(kw["cu_seqlens"]) - 1 if "cu_seqlens" in kw else xs[0].shape[0]
                ff = (n,) + ((xs[2].shape[2], xs[0].shape[3], xs[2].shape[3]) if op == "kda" else xs[0].shape[2:])
            w = loss_weights(seed, fo, ff)
            backend = "triton" if triton else "torch"
            got = sharded(context_parallel[op], xs, kw, w, world, backend=backend, state_passing=sp)
            if not triton:
                want = single_process(single[op], xs, kw, w, backend="torch")
                pairs = [("o", got[0], dd.shard(want[0]))] + ([("final", got[1], want[1])] if ff else [])
                pairs += [(nm, a, dd.shard(b) if i < len(xs) else b)
                          for i, (nm, a, b) in enumerate(zip(grad_names(kw, len(xs)), got[2], want[2]))]
                for nm, a, b in pairs:
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"{tag} {nm}: {m}")
                continue
            r64 = single_process(ref[op], [x.double() for x in xs],
                                 {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t)
                                  for n, t in kw.items()}, w)
            low = single_process(ref[op], xs, kw, w, upcast=False)
            lone = single_process(single[op], xs, kw, w, backend="triton")       # the single-process operator
            with torch.no_grad():           # no gradient: KDA's inference pipeline (16- or 32-token chunks)
                fwd = context_parallel[op](*(dd.shard(x) for x in xs), **kw, backend="triton", state_passing=sp)
            # (name, result, index into r64 / a baseline (grads: 2 + i), sharded like the inputs)
            nx = len(xs)
            rows = [("o", got[0], 0, True), ("o without grad", fwd[0], 0, True)]
            if ff:
                rows += [("final", got[1], 1, False), ("final without grad", fwd[1], 1, False)]
            rows += [(nm, a, 2 + i, i < nx) for i, (nm, a) in enumerate(zip(grad_names(kw, nx), got[2]))]
            bad = []
            for what, base, floor in (("the reference", low, None), ("the single-process op", lone, _TIGHT)):
                for nm, a, j, part in rows:
                    b, c = (r64[j], base[j]) if j < 2 else (r64[2][j - 2], base[2][j - 2])
                    b, c = (dd.shard(b), dd.shard(c)) if part else (b, c)
                    v = check(a, b, c, kind="fwd" if j < 2 else "grad", name=nm,
                              floor=None if floor is None else floor(b))
                    if not v.ok:
                        bad.append(f"against {what}: {v.message}")
            assert not bad, f"{tag}: " + "; ".join(bad)
    linear._KDA.fuse_ok = fuse_ok
    _errors_and_no_grad(rank, world)


def _errors_and_no_grad(rank, world):
    import delta_attn as da
    import delta_attn.distributed as dd
    xs, kw, _, _ = _case(1, "kda", world, False)
    kw.pop("cu_seqlens", None)
    kw["initial_state"] = None
    loc = [dd.shard(x) for x in xs]
    # inference (no autograd): both schemes give the single-process output
    want = dd.shard(da.kda(*xs, **kw, backend="torch")[0])
    for sp in ("allgather", "ring"):
        with torch.no_grad():
            torch.testing.assert_close(dd.kda(*loc, **kw, backend="torch", state_passing=sp)[0], want)
    with pytest.raises(ValueError, match="state_passing"):
        dd.kda(*loc, state_passing="tree")
    total = world * loc[0].shape[1]
    with pytest.raises(ValueError, match="cu_seqlens"):      # must end at W * T_local, not T_local
        dd.gated_diag_attn(*(x[:1, :, :1, :2] for x in loc[:3]), loc[3][:1, :, :1, :2],
                           cu_seqlens=torch.tensor([0, total // world], dtype=torch.int32))
    with pytest.raises(ValueError, match="B == 1"):
        dd.kda(*(x.expand(2, *x.shape[1:]) for x in loc), cu_seqlens=torch.tensor([0, total], dtype=torch.int32))
    with pytest.raises(ValueError, match="initial_state"):
        dd.kda(*loc, initial_state=torch.zeros(7, 1, 1, 1, dtype=torch.float64))


@pytest.mark.parametrize("world", [2, 3])
def test_state_passing_matches_single_process(world):
    run_ranks(world, _body, ("kda", "diag"), TORCH_CASES, TRITON_CASES)


def _kda_memory_body(rank, world):
    import delta_attn as da
    import delta_attn.distributed as dd
    t_local, h, kd, vd = 70, 2, 16, 32                 # carried pieces of two 64-token chunks
    gen = torch.Generator().manual_seed(0)
    total = world * t_local
    for b, cu in ((2, None), (1, [0, 5, total - 3, total])):
        full = [torch.randn(b, total, h, kd, generator=gen) for _ in range(2)] + [
            torch.randn(b, total, h, vd, generator=gen),
            torch.nn.functional.logsigmoid(torch.randn(b, total, h, kd, generator=gen) + 2.0),
            torch.rand(b, total, h, generator=gen)]
        loc = [dd.shard(x).detach().requires_grad_() for x in full]
        kw = dict(use_qk_l2norm=True, backend="triton")
        one, _ = saved_bytes(lambda: da.kda(*loc, **kw))
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        cp, _ = saved_bytes(lambda: dd.kda(*loc, cu_seqlens=cu_t, **kw))
        assert cp <= 1.25 * one, f"rank {rank} cu={cu}: the context-parallel backward keeps {cp} bytes, the " \
                                 f"operator on the shard {one}"


def test_kda_saved_for_backward_is_the_operators():
    """What dd.kda's Triton forward keeps for its backward: the single-GPU operator's saved tensors on the shard
    (the carry folded into them) plus u, the carried rows' response (K columns), within 1.25x (dense: the
    carried rank's every row; packed: a first piece across the whole shard but 5 tokens)."""
    pytest.importorskip("triton")
    run_ranks(2, _kda_memory_body)
