"""Issue 15: the Triton flash backward where a tile holds keys past the end of the sequence and a
row's visible scores are very negative (fp16 inputs, Triton interpreter on CPU).

Keys past Sk load as zero, so their raw score is 0 (or the ALiBi term alone) while the row's lse sits
far below it: an unmasked ``p = exp(s - lse)`` there is huge, ``ds = p (dp - delta)`` overflows fp16
when it is cast for the dS.K product, and ``inf * 0`` put NaN into dQ (before the fix: the dK/dV pass
overflowed the same way on its rows past Sk, which it never stores). Every case compares with the
float64 reference under the DESIGN error rule (NaN never passes), outputs poisoned with NaN.
"""
import pytest
import torch

import delta_attn as da
from delta_attn import reference
from delta_attn.testing import assert_close, attention_grad_floor

pytest.importorskip("triton")
DT = torch.float16
# under the interpreter the kernels' arithmetic is NumPy's: an fp overflow or an inf - inf there fails
pytestmark = pytest.mark.filterwarnings("error:(overflow|invalid value) encountered:RuntimeWarning")
NAMES = ("out", "lse", "dq", "dk", "dv")


def _inputs(shapes, scale=1.0):
    return [(torch.randn(s, dtype=torch.float32) * scale).to(DT).requires_grad_() for s in shapes]


def _aligned(shapes, shift=2.0):
    """q near -u and k near +u (u = shift in every channel): every score is about -scale * shift^2 * D,
    so every row sees only very negative scores, however many keys it sees."""
    q = -shift + 0.3 * torch.randn(shapes[0])
    k = shift + 0.3 * torch.randn(shapes[1])
    return [t.to(DT).requires_grad_() for t in (q, k, torch.randn(shapes[2]))]


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do)


def _check(got, res, names=NAMES):
    grads64 = [r for r, n in zip(res["64"], names) if n.startswith("d")]
    for g, r, l, n in zip(got, res["64"], res["low"], names):
        grad = n.startswith("d")
        assert_close(g, r, l, kind="grad" if grad else "fwd", name=n,
                     floor=attention_grad_floor(grads64, DT) if grad else None)


def _ref(fn, xs, do, **kw):
    res = {}
    for name, dt, up in (("64", torch.float64, True), ("low", DT, False)):
        ys = [t.detach().to(dt).requires_grad_() for t in xs]
        o, l = fn(*ys, upcast=up, **kw)
        res[name] = (o, l, *_grads(o, ys, do.to(dt)))
    return res


def _very_negative_rows(lse, threshold=-12.0):
    """Rows whose lse is below ``threshold``: an unmasked zero score there gives p > e^12 > fp16 max."""
    return int(((lse < threshold) & torch.isfinite(lse)).sum())


# (Sq, Sk, D, inputs, options): Sk small against the 16-key interpreter tile (64 / 128 on the GPU).
# inputs: a float scales randn q / k / v (with a negative or large softmax_scale, or large q / k, many
# rows see only very negative scores); "aligned" makes every score very negative (see _aligned)
DENSE_CASES = [
    (17, 1, 16, 1.0, dict(softmax_scale=-10.0)),                          # the shape
    (17, 5, 16, "aligned", dict(causal=True)),                            # causal masks keys past Sk itself
    (17, 3, 48, "aligned", dict(window_size=(-1, 2))),                    # the window reaches past Sk
    (17, 5, 16, 6.0, dict()),                                             # large q / k, default scale
    (17, 1, 16, 1.0, dict(softmax_scale=8.0, softcap=40.0)),              # softcap: tanh(0) = 0 past Sk
    (20, 7, 32, "aligned", dict(alibi_slopes=True)),                      # ALiBi alone scores keys past Sk
    (40, 33, 16, "aligned", dict(softmax_scale=0.5)),                     # a full tile and a 1-key tile
    (23, 18, 16, "aligned", dict(window_size=(4, 1))),                    # window bands near the end
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: f"Sq{c[0]}-Sk{c[1]}-D{c[2]}-x{c[3]}-{c[4]}")
def test_dense_short_key_tile_very_negative_scores(case, poisoned):
    sq, sk, d, scale, kw = case
    hq, hk = 2, 1
    kw = dict(kw)
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.rand(hq) * 0.5
    shapes = [(1, sq, hq, d), (1, sk, hk, d), (1, sk, hk, d)]
    q, k, v = _aligned(shapes) if scale == "aligned" else _inputs(shapes, scale)
    out, lse, _ = da.flash_attn_func(q, k, v, return_attn_probs=True, backend="triton", **kw)
    assert _very_negative_rows(lse) > 0, "the case must hold rows with very negative scores"
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    for n, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), f"{n} holds {int((~torch.isfinite(g)).sum())} non-finite values"
    # one key: p = 1 in every row, so the true dq and dk are exactly 0: the shared attention-gradient floor
    _check((out, lse, *grads), _ref(reference.attention, (q, k, v), do, **kw))


def test_rows_without_visible_key_have_exactly_zero_gradients(poisoned):
    # Sq > Sk with causal: queries 0..14 see no key (lse = +inf); the others see very negative scores
    # in a tile whose keys 5..15 lie past Sk
    q, k, v = _inputs([(1, 20, 2, 16), (1, 5, 2, 16), (1, 5, 2, 16)])
    kw = dict(causal=True, softmax_scale=-10.0)
    out, lse, _ = da.flash_attn_func(q, k, v, return_attn_probs=True, backend="triton", **kw)
    do = torch.randn_like(out)
    dq, dk, dv = _grads(out, (q, k, v), do)
    assert torch.isinf(lse[:, :, :15]).all() and (lse[:, :, :15] > 0).all()
    assert torch.equal(out[:, :15], torch.zeros_like(out[:, :15]))
    assert torch.equal(dq[:, :15], torch.zeros_like(dq[:, :15]))
    _check((out, lse, dq, dk, dv), _ref(reference.attention, (q, k, v), do, **kw))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["thd", "htd"])
def test_varlen_zero_and_one_length_sequences_very_negative_scores(layout, causal, poisoned):
    # 0- and 1-length q / k sequences next to longer ones: the 1-key sequences put one real key in
    # a 16-key tile; a zero-length key sequence leaves its queries with no key at all
    lq, lk = [0, 1, 17, 1, 3, 19, 2], [0, 1, 20, 1, 0, 1, 17]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lq, lk))
    heads_first = layout == "htd"
    q, k, v = _inputs([(2, sum(lq), 16) if heads_first else (sum(lq), 2, 16)]
                      + [(1, sum(lk), 16) if heads_first else (sum(lk), 1, 16)] * 2)
    kw = dict(causal=causal, softmax_scale=-10.0)
    out, lse, _ = da.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True,
                                            layout=layout, backend="triton", **kw)
    assert _very_negative_rows(lse) > 0
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    for n, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), f"{n} holds {int((~torch.isfinite(g)).sum())} non-finite values"
    # the queries of the sequence with no key (index 4): zero output, zero dq
    a, b = int(cu_q[4]), int(cu_q[5])
    dq = grads[0] if layout == "thd" else grads[0].transpose(0, 1)
    assert torch.equal(dq[a:b], torch.zeros_like(dq[a:b]))
    fn = lambda *xs, upcast: reference.attention_varlen(*xs, cu_q, cu_k, layout=layout, upcast=upcast, **kw)  # noqa: E731
    _check((out, lse, *grads), _ref(fn, (q, k, v), do))
