"""Experiment: the KDA decode step in Gluon, with explicit register layouts (one token, no slots, raw gate,
q/k L2 norm; the benchmark case of steps_vs_copy.py). q, k and the decay are loaded straight into the state
tile's row slice and v into its column slice, so no layout conversion runs; with the K axis inside a warp
(``threads_per_warp`` [8, 4] or [16, 2]) the reductions over K are shuffles only and the step has no barrier."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def kda_step_gluon(q, k, v, g, beta, S, O, scale, H, HV, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                   L: gl.constexpr):
    iv = gl.program_id(0)
    bi = gl.program_id(1).to(gl.int64)
    hv = gl.program_id(2).to(gl.int64)
    h = hv // (HV // H)
    LK: gl.constexpr = gl.SliceLayout(1, L)
    LV: gl.constexpr = gl.SliceLayout(0, L)
    kk = gl.arange(0, K, layout=LK)
    vv = iv * BV + gl.arange(0, BV, layout=LV)
    ptr = S + (bi * HV + hv) * (K * V) + gl.expand_dims(kk, 1) * V + gl.expand_dims(vv, 0)
    st = gl.load(ptr)
    qv = gl.load(q + (bi * H + h) * K + kk).to(gl.float32)
    kv = gl.load(k + (bi * H + h) * K + kk).to(gl.float32)
    x = gl.load(g + (bi * HV + hv) * K + kk).to(gl.float32)
    b = gl.load(beta + bi * HV + hv).to(gl.float32)
    vt = gl.load(v + (bi * HV + hv) * V + vv).to(gl.float32)
    qv = qv / gl.sqrt(gl.sum(qv * qv, 0) + 1e-6) * scale
    kv = kv / gl.sqrt(gl.sum(kv * kv, 0) + 1e-6)
    st = st * gl.expand_dims(gl.exp(x), 1)
    kc = gl.expand_dims(kv, 1)
    p = gl.sum(st * kc, 0)
    r = gl.sum(st * gl.expand_dims(qv, 1), 0)
    u = b * (vt - p)
    o = r + gl.sum(kv * qv, 0) * u
    st = st + kc * gl.expand_dims(u, 0)
    gl.store(O + (bi * HV + hv) * V + vv, o.to(O.dtype.element_ty))
    gl.store(ptr, st)


def layouts():
    """(name, BV, warps, layout) candidates."""
    B = gl.BlockedLayout
    return [
        ("BV64 w4 tpw[2,16] wpc[4,1] (Triton's)", 64, 4, B([1, 4], [2, 16], [4, 1], [1, 0])),
        ("BV64 w4 tpw[8,4] wpc[1,4]", 64, 4, B([1, 4], [8, 4], [1, 4], [1, 0])),
        ("BV64 w4 tpw[16,2] wpc[1,4]", 64, 4, B([1, 4], [16, 2], [1, 4], [1, 0])),
        ("BV32 w2 tpw[8,4] wpc[1,2]", 32, 2, B([1, 4], [8, 4], [1, 2], [1, 0])),
        ("BV32 w4 tpw[16,2] wpc[1,4]", 32, 4, B([1, 4], [16, 2], [1, 4], [1, 0])),
        ("BV128 w8 tpw[8,4] wpc[1,8]", 128, 8, B([1, 4], [8, 4], [1, 8], [1, 0])),
        ("BV128 w4 tpw[8,4] wpc[1,4]", 128, 4, B([1, 4], [8, 4], [1, 4], [1, 0])),
        ("BV64 w8 tpw[16,2] wpc[1,8]", 64, 8, B([1, 4], [16, 2], [1, 8], [1, 0])),
    ]
