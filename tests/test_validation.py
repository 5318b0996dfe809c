"""Every bad input raises ValueError/TypeError before anything runs, naming the argument."""
import pytest
import torch

import delta_attn as da

I32 = torch.int32


def attn(**over):
    kw = dict(q=torch.randn(2, 5, 4, 16), k=torch.randn(2, 7, 2, 16), v=torch.randn(2, 7, 2, 16))
    kw.update(over)
    return kw


def varlen(**over):
    kw = dict(q=torch.randn(9, 4, 16), k=torch.randn(9, 2, 16), v=torch.randn(9, 2, 16),
              cu_seqlens_q=torch.tensor([0, 4, 9], dtype=I32), cu_seqlens_k=torch.tensor([0, 4, 9], dtype=I32),
              max_seqlen_q=5, max_seqlen_k=5)
    kw.update(over)
    return kw


def kda_args(**over):
    b, t, h, hv, kd, vd = 2, 5, 2, 4, 8, 6
    kw = dict(q=torch.randn(b, t, h, kd), k=torch.randn(b, t, h, kd), v=torch.randn(b, t, hv, vd),
              g=-torch.rand(b, t, hv, kd), beta=torch.rand(b, t, hv))
    kw.update(over)
    return kw


def diag_args(**over):
    kw = dict(q=torch.randn(2, 5, 3, 8), k=torch.randn(2, 5, 3, 8), v=torch.randn(2, 5, 3, 8), g=-torch.rand(2, 5, 3, 8))
    kw.update(over)
    return kw


def call_attn(kw):
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    return da.flash_attn_func(q, k, v, backend="torch", **kw)


def call_varlen(kw):
    args = [kw.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    return da.flash_attn_varlen_func(*args, backend="torch", **kw)


def call_kda(kw):
    args = [kw.pop(n) for n in ("q", "k", "v", "g", "beta")]
    return da.kda(*args, backend="torch", **kw)


def call_kda_step(kw):
    kw.setdefault("state", torch.zeros(2, 4, 8, 6))
    args = [kw.pop(n) for n in ("q", "k", "v", "g", "beta", "state")]
    return da.kda_step(*args, backend="torch", **kw)


def call_diag(kw):
    args = [kw.pop(n) for n in ("q", "k", "v", "g")]
    return da.gated_diag_attn(*args, backend="torch", **kw)


def call_diag_step(kw):
    kw.setdefault("state", torch.zeros(2, 3, 8))
    args = [kw.pop(n) for n in ("q", "k", "v", "g", "state")]
    return da.gated_diag_step(*args, backend="torch", **kw)


CASES = [
    # --- attention: ranks, shapes, heads, dtypes, devices
    ("attn q rank", call_attn, attn(q=torch.randn(5, 4, 16)), ValueError, r"q must be 4-D"),
    ("attn q not tensor", call_attn, attn(q=[1.0]), TypeError, r"q must be a torch.Tensor"),
    ("attn batch mismatch", call_attn, attn(k=torch.randn(3, 7, 2, 16)), ValueError, r"k batch size"),
    ("attn k/v length", call_attn, attn(v=torch.randn(2, 6, 2, 16)), ValueError, r"v sequence length"),
    ("attn k/v heads", call_attn, attn(v=torch.randn(2, 7, 1, 16)), ValueError, r"v heads"),
    ("attn head dim", call_attn, attn(k=torch.randn(2, 7, 2, 8)), ValueError, r"k head dim must equal q"),
    ("attn gqa ratio", call_attn, attn(k=torch.randn(2, 7, 3, 16), v=torch.randn(2, 7, 3, 16)), ValueError,
     r"q heads \(4\) must be a multiple of k heads \(3\)"),
    ("attn mixed dtype", call_attn, attn(k=torch.randn(2, 7, 2, 16, dtype=torch.float16)), TypeError,
     r"k must have the dtype of q"),
    ("attn int dtype", call_attn, attn(q=torch.ones(2, 5, 4, 16, dtype=torch.int32)), TypeError, r"q must be float16"),
    ("attn mixed device", call_attn, attn(v=torch.randn(2, 7, 2, 16, device="meta")), ValueError,
     r"v must be on the device of q"),
    # --- attention options
    ("window below -1", call_attn, attn(window_size=(-2, 0)), ValueError, r"window_size entries must be >= -1"),
    ("window not pair", call_attn, attn(window_size=3), TypeError, r"window_size must be a pair"),
    ("softcap negative", call_attn, attn(softcap=-1.0), ValueError, r"softcap must be >= 0"),
    ("softcap inf", call_attn, attn(softcap=float("inf")), ValueError, r"softcap must be a finite number >= 0"),
    ("softcap nan", call_attn, attn(softcap=float("nan")), ValueError, r"softcap must be a finite number"),
    ("scale inf", call_attn, attn(softmax_scale=float("inf")), ValueError, r"softmax_scale must be a finite number, got inf"),
    ("scale -inf", call_attn, attn(softmax_scale=float("-inf")), ValueError, r"softmax_scale must be a finite number, got -inf"),
    ("scale nan", call_attn, attn(softmax_scale=float("nan")), ValueError, r"softmax_scale must be a finite number, got nan"),
    ("scale type", call_attn, attn(softmax_scale="0.1"), TypeError, r"softmax_scale must be a number"),
    ("dropout 1", call_attn, attn(dropout_p=1.0), ValueError, r"dropout_p must be in \[0.0, 1.0\)"),
    ("dropout negative", call_attn, attn(dropout_p=-0.1), ValueError, r"dropout_p"),
    ("dropout type", call_attn, attn(dropout_p="0.1"), TypeError, r"dropout_p must be a number"),
    ("alibi shape", call_attn, attn(alibi_slopes=torch.rand(2)), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
    ("alibi dtype", call_attn, attn(alibi_slopes=torch.rand(4, dtype=torch.float64)), TypeError, r"alibi_slopes must be float32"),
    ("causal not bool", call_attn, attn(causal=1), TypeError, r"causal must be a bool"),
    ("unknown backend", lambda kw: da.flash_attn_func(kw["q"], kw["k"], kw["v"], backend="cuda"), attn(), ValueError,
     r"backend must be one of"),
    # --- varlen
    ("cu float", call_varlen, varlen(cu_seqlens_q=torch.tensor([0., 4., 9.])), TypeError,
     r"cu_seqlens_q must be int32 or int64, got torch.float32"),
    ("cu beyond int32", call_varlen, varlen(cu_seqlens_q=torch.tensor([0, 2 ** 32, 9])), ValueError,
     r"cu_seqlens_q values must fit int32"),
    ("cu 2-D", call_varlen, varlen(cu_seqlens_k=torch.tensor([[0, 4, 9]], dtype=I32)), ValueError, r"cu_seqlens_k must be 1-D"),
    ("cu start", call_varlen, varlen(cu_seqlens_q=torch.tensor([1, 4, 9], dtype=I32)), ValueError, r"cu_seqlens_q must start at 0"),
    ("cu decreasing", call_varlen, varlen(cu_seqlens_q=torch.tensor([0, 6, 5, 9], dtype=I32),
                                          cu_seqlens_k=torch.tensor([0, 6, 5, 9], dtype=I32)), ValueError, r"non-decreasing"),
    ("cu total", call_varlen, varlen(cu_seqlens_k=torch.tensor([0, 4, 8], dtype=I32)), ValueError,
     r"cu_seqlens_k\[-1\] must equal the number of packed tokens \(9\)"),
    ("cu count", call_varlen, varlen(cu_seqlens_k=torch.tensor([0, 9], dtype=I32), max_seqlen_k=9), ValueError, r"as many sequences"),
    ("max_seqlen small", call_varlen, varlen(max_seqlen_q=4), ValueError, r"max_seqlen_q must be >= the longest sequence"),
    ("max_seqlen type", call_varlen, varlen(max_seqlen_k=5.0), TypeError, r"max_seqlen_k must be an int"),
    ("varlen rank", call_varlen, varlen(q=torch.randn(1, 9, 4, 16)), ValueError, r"q must be 3-D"),
    ("unknown layout", call_varlen, varlen(layout="bshd"), ValueError, r"layout must be one of 'thd', 'htd'"),
    ("varlen scale inf", call_varlen, varlen(softmax_scale=float("inf")), ValueError, r"softmax_scale must be a finite number"),
    ("varlen scale nan", call_varlen, varlen(softmax_scale=float("nan")), ValueError, r"softmax_scale must be a finite number"),
    ("varlen softcap inf", call_varlen, varlen(softcap=float("inf")), ValueError, r"softcap must be a finite number"),
    ("varlen alibi batch", call_varlen, varlen(alibi_slopes=torch.rand(3, 4)), ValueError, r"alibi_slopes must have shape"),
    # --- KDA
    ("kda q rank", call_kda, kda_args(q=torch.randn(5, 2, 8)), ValueError, r"q must be 4-D"),
    ("kda k shape", call_kda, kda_args(k=torch.randn(2, 5, 2, 4)), ValueError, r"k must have shape \(2, 5, 2, 8\)"),
    ("kda v length", call_kda, kda_args(v=torch.randn(2, 4, 4, 6)), ValueError, r"v batch and length"),
    ("kda HV % H", call_kda, kda_args(v=torch.randn(2, 5, 3, 6), g=-torch.rand(2, 5, 3, 8), beta=torch.rand(2, 5, 3)),
     ValueError, r"value heads HV \(v.shape\[2\]\) \(3\) must be a multiple of query heads H"),
    ("kda g shape", call_kda, kda_args(g=torch.randn(2, 5, 4, 6)), ValueError, r"g must have shape \(2, 5, 4, 8\)"),
    ("kda beta shape", call_kda, kda_args(beta=torch.rand(2, 5, 2)), ValueError, r"beta must have shape \(2, 5, 4\)"),
    ("kda mixed dtype", call_kda, kda_args(v=torch.randn(2, 5, 4, 6, dtype=torch.float64)), TypeError, r"v must have the dtype of q"),
    ("kda g dtype", call_kda, kda_args(g=-torch.rand(2, 5, 4, 8, dtype=torch.float64)), TypeError, r"g must have the dtype of q"),
    ("kda device", call_kda, kda_args(beta=torch.rand(2, 5, 4, device="meta")), ValueError, r"beta must be on the device"),
    ("kda state shape", call_kda, kda_args(initial_state=torch.zeros(2, 4, 6, 8)), ValueError,
     r"initial_state must have shape \(2, 4, 8, 6\)"),
    ("kda state dtype", call_kda, kda_args(initial_state=torch.zeros(2, 4, 8, 6, dtype=torch.float16)), TypeError,
     r"initial_state must be float32 or float64"),
    ("kda varlen B>1", call_kda, kda_args(cu_seqlens=torch.tensor([0, 5], dtype=I32)), ValueError,
     r"with cu_seqlens the batch must be packed into B == 1"),
    ("kda varlen state count", call_kda, dict(kda_args(**{n: t[:1] for n, t in kda_args().items()}),
                                              cu_seqlens=torch.tensor([0, 2, 5], dtype=I32),
                                              initial_state=torch.zeros(1, 4, 8, 6)), ValueError,
     r"initial_state must have shape \(2, 4, 8, 6\)"),
    ("kda dt_bias without A_log", call_kda, kda_args(dt_bias=torch.zeros(32)), ValueError, r"dt_bias needs A_log"),
    ("kda lower_bound without A_log", call_kda, kda_args(lower_bound=-5.0), ValueError, r"lower_bound needs A_log"),
    ("kda A_log shape", call_kda, kda_args(A_log=torch.zeros(2)), ValueError, r"A_log must have shape \(4,\)"),
    ("kda dt_bias shape", call_kda, kda_args(A_log=torch.zeros(4), dt_bias=torch.zeros(4, 8)), ValueError, r"dt_bias must be 1-D"),
    ("kda lower_bound positive", call_kda, kda_args(A_log=torch.zeros(4), lower_bound=1.0), ValueError,
     r"lower_bound must be a finite number < 0"),
    ("kda unknown backend", lambda kw: da.kda(*kw.values(), backend="cudnn2"), kda_args(), ValueError, r"backend must be one of"),
    # --- KDA decode
    ("kda_step state shape", call_kda_step, kda_args(state=torch.zeros(2, 4, 8, 5)), ValueError, r"state must have shape"),
    ("kda_step state dtype", call_kda_step, kda_args(state=torch.zeros(2, 4, 8, 6, dtype=torch.bfloat16)), TypeError,
     r"state must be float32 or float64"),
    ("kda_step indices range", call_kda_step, kda_args(state=torch.zeros(3, 4, 8, 6), state_indices=torch.tensor([0, 3])),
     ValueError, r"state_indices must lie in \[0, 3\)"),
    ("kda_step indices repeat", call_kda_step, kda_args(state=torch.zeros(3, 4, 8, 6), state_indices=torch.tensor([1, 1])),
     ValueError, r"must not repeat"),
    ("kda_step indices dtype", call_kda_step, kda_args(state_indices=torch.tensor([0.0, 1.0])), TypeError,
     r"state_indices must be int32 or int64"),
    ("kda_step pool without indices", call_kda_step, kda_args(state=torch.zeros(3, 4, 8, 6)), ValueError,
     r"one slot per sequence"),
    # --- gated diagonal
    ("diag rank", call_diag, diag_args(q=torch.randn(5, 3, 8)), ValueError, r"q must be 4-D"),
    ("diag shape", call_diag, diag_args(v=torch.randn(2, 5, 3, 7)), ValueError, r"v must have shape \(2, 5, 3, 8\)"),
    ("diag g shape", call_diag, diag_args(g=torch.randn(2, 4, 3, 8)), ValueError, r"g must have shape"),
    ("diag dtype", call_diag, diag_args(k=torch.randn(2, 5, 3, 8, dtype=torch.float16)), TypeError, r"k must have the dtype of q"),
    ("diag device", call_diag, diag_args(g=torch.randn(2, 5, 3, 8, device="meta")), ValueError, r"g must be on the device"),
    ("diag state shape", call_diag, diag_args(initial_state=torch.zeros(2, 3, 7)), ValueError,
     r"initial_state must have shape \(2, 3, 8\)"),
    ("diag state dtype", call_diag, diag_args(initial_state=torch.zeros(2, 3, 8, dtype=torch.float16)), TypeError,
     r"initial_state must be float32"),
    ("diag varlen B>1", call_diag, diag_args(cu_seqlens=torch.tensor([0, 5], dtype=I32)), ValueError, r"packed into B == 1"),
    ("diag_step indices range", call_diag_step, diag_args(state=torch.zeros(4, 3, 8), state_indices=torch.tensor([-1, 2])),
     ValueError, r"state_indices must lie in \[0, 4\)"),
    ("diag_step state rank", call_diag_step, diag_args(state=torch.zeros(2, 3, 8, 1)), ValueError, r"state must be 3-D"),
]


@pytest.mark.parametrize("name,fn,kwargs,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named(name, fn, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fn(dict(kwargs))


def test_good_inputs_pass_validation():
    """The templates above are valid: each error comes from the one thing each case changed."""
    call_attn(attn())
    call_varlen(varlen())
    call_kda(kda_args())
    call_kda_step(kda_args())
    call_diag(diag_args())
    call_diag_step(diag_args())


@pytest.mark.parametrize("scale", [-0.3, -10.0, 1e-30, 7])
def test_any_finite_softmax_scale_is_accepted(scale):
    """DESIGN: any finite scale (negative, tiny, an int) runs and gives a finite result."""
    assert torch.isfinite(call_attn(attn(softmax_scale=scale))).all()
    assert torch.isfinite(call_varlen(varlen(softmax_scale=scale, softcap=2.5))).all()


@pytest.mark.parametrize("bad", [dict(softmax_scale=float("inf")), dict(softmax_scale=float("nan"))])
def test_layers_forward_scale_through_the_shared_check(bad):
    """The nn layers and the transformers integration pass softmax_scale / softcap to flash_attn_func /
    flash_attn_varlen_func, whose shared check refuses a non-finite value by name."""
    import delta_attn.nn as dnn
    name = next(iter(bad))
    attn_layer = dnn.MultiheadAttention(32, num_heads=2, backend="torch", **bad)
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        attn_layer(torch.randn(2, 5, 32))
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):      # padded: the varlen path
        attn_layer(torch.randn(2, 5, 32), attention_mask=torch.tensor([[1] * 5, [0, 1, 1, 1, 1]]))
    xattn = dnn.GQACrossAttention(32, num_heads=2, num_kv_heads=1, backend="torch", **bad)
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        xattn(torch.randn(2, 5, 32), torch.randn(2, 3, 32))


def test_number_check_words():
    from delta_attn import _checks as C
    assert C.number("x", 3) == 3.0 and C.number("x", -2.5, finite=True) == -2.5
    with pytest.raises(ValueError, match=r"x must be a number, not NaN, got nan"):
        C.number("x", float("nan"))
    with pytest.raises(ValueError, match=r"x must be a finite number in \[0, 1\], got inf"):
        C.number("x", float("inf"), 0, 1, finite=True)
    C.number("x", float("inf"))                       # without finite=True, inf stays allowed


def test_validation_runs_before_any_backend(monkeypatch):
    from delta_attn import backends
    ran = []
    monkeypatch.setattr(backends, "select", lambda *a, **k: ran.append(1))
    with pytest.raises(ValueError):
        call_attn(attn(softcap=-1.0))
    assert ran == []


def test_value_checks_can_be_skipped_to_stay_asynchronous(monkeypatch):
    """DELTA_ATTN_SKIP_VALUE_CHECKS=1 drops only the checks that read device values on the host."""
    monkeypatch.setenv("DELTA_ATTN_SKIP_VALUE_CHECKS", "1")
    from delta_attn.ops.flash.api import validate_varlen
    kw = varlen(cu_seqlens_q=torch.tensor([0, 6, 5, 9], dtype=I32), cu_seqlens_k=torch.tensor([0, 6, 5, 9], dtype=I32))
    validate_varlen(**kw)                                  # decreasing values: not read, not caught
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32 or int64"):
        validate_varlen(**varlen(cu_seqlens_q=torch.tensor([0., 4., 9.])))


def test_value_checks_are_skipped_under_cuda_graph_capture(monkeypatch):
    """A host read of state_indices cannot be captured in a CUDA graph: under capture the value checks are off
    (bad indices then go unchecked, as with DELTA_ATTN_SKIP_VALUE_CHECKS=1); outside capture they run."""
    from delta_attn import _checks
    bad = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="state_indices must lie in"):
        _checks.state_indices(bad, 2, 4, bad.device)
    monkeypatch.setattr(_checks, "_capturing", lambda: True)
    _checks.state_indices(bad, 2, 4, bad.device)
