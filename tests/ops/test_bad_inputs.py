"""Every bad input of every public operator: for every argument, a wrong type, dtype, rank, shape, device or
value raises TypeError / ValueError whose message names the argument, before anything runs (every backend's
implementation is replaced by one that fails the test if it is reached); where a message's wording is part of
the contract, :data:`WORDING` holds it. Where accepting an input is right (int64 or strided cu_seqlens, strided or
int64 state_indices, float32 gates with half inputs, empty sequences and batches, max_seqlen above the longest
sequence, any finite softmax_scale), the call runs and matches the float64 reference by the error rule
(docs/TESTING.md, tests/properties.py), on the torch and triton backends. Last, the checks themselves: they run
before dispatch, the layers reach them, and the value checks that read the device can be skipped.
"""
from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

import delta_attn as da
from delta_attn import backends
from delta_attn.backends import UnsupportedError

import properties as P

I32, I64, F32 = torch.int32, torch.int64, torch.float32
NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------------------------
# valid calls (keyword arguments); each case changes one argument
# ---------------------------------------------------------------------------------------------

def _flash():
    return dict(q=torch.randn(2, 5, 4, 16), k=torch.randn(2, 7, 2, 16), v=torch.randn(2, 7, 2, 16),
                dropout_p=0.0, softmax_scale=0.25, causal=False, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=torch.rand(4), deterministic=False, return_attn_probs=False)


def _varlen():
    cu = torch.tensor([0, 4, 4, 9], dtype=I32)
    return dict(q=torch.randn(9, 4, 16), k=torch.randn(9, 2, 16), v=torch.randn(9, 2, 16), cu_seqlens_q=cu,
                cu_seqlens_k=cu.clone(), max_seqlen_q=5, max_seqlen_k=5, dropout_p=0.0, softmax_scale=0.25,
                causal=True, window_size=(3, -1), softcap=1.5, alibi_slopes=torch.rand(3, 4), deterministic=False,
                return_attn_probs=False, layout="thd")


def _kda(varlen=False):
    b, t, h, hv, kd, vd = (1, 9, 2, 4, 8, 6) if varlen else (2, 5, 2, 4, 8, 6)
    kw = dict(q=torch.randn(b, t, h, kd), k=torch.randn(b, t, h, kd), v=torch.randn(b, t, hv, vd),
              g=torch.randn(b, t, hv, kd), beta=torch.rand(b, t, hv), scale=0.3,
              initial_state=torch.zeros(3 if varlen else b, hv, kd, vd), output_final_state=True,
              use_qk_l2norm=True, A_log=torch.zeros(hv), dt_bias=torch.zeros(hv * kd), lower_bound=-5.0)
    if varlen:
        kw["cu_seqlens"] = torch.tensor([0, 4, 4, 9], dtype=I32)
    return kw


def _as_step(kw, pool_shape, indices):
    """A whole-sequence call made a decode call: no initial / final state, a pool of 3 slots, two sequences."""
    for n in ("initial_state", "output_final_state"):
        kw.pop(n)
    kw.update(state=torch.zeros(pool_shape), state_indices=indices)
    return kw


def _kda_step():
    return _as_step(_kda(), (3, 4, 8, 6), torch.tensor([2, 0], dtype=I32))


def _diag(varlen=False):
    b, t = (1, 9) if varlen else (2, 5)
    kw = dict(q=torch.randn(b, t, 3, 8), k=torch.randn(b, t, 3, 8), v=torch.randn(b, t, 3, 8),
              g=-torch.rand(b, t, 3, 8), initial_state=torch.zeros(3 if varlen else b, 3, 8), output_final_state=True)
    if varlen:
        kw["cu_seqlens"] = torch.tensor([0, 4, 4, 9], dtype=I32)
    return kw


def _diag_step():
    return _as_step(_diag(), (3, 3, 8), torch.tensor([2, 0], dtype=I64))


def _speculative(kw, pool_shape):
    """A decode call with speculative (B, T) slots (T = 5, a pool of 10) and accepted-token counts."""
    kw.update(state=torch.zeros(pool_shape), state_indices=torch.arange(10, dtype=I32).view(2, 5).flip(1),
              num_accepted_tokens=torch.tensor([3, 5], dtype=I32))
    return kw


VALID = {"flash": _flash, "flash_varlen": _varlen, "kda": _kda, "kda_varlen": lambda: _kda(True),
         "kda_step": _kda_step, "diag": _diag, "diag_varlen": lambda: _diag(True), "diag_step": _diag_step,
         "kda_step_spec": lambda: _speculative(_kda_step(), (10, 4, 8, 6)),
         "diag_step_spec": lambda: _speculative(_diag_step(), (10, 3, 8))}
FN = {"flash": da.flash_attn_func, "flash_varlen": da.flash_attn_varlen_func, "kda": da.kda, "kda_varlen": da.kda,
      "kda_step": da.kda_step, "diag": da.gated_diag_attn, "diag_varlen": da.gated_diag_attn,
      "diag_step": da.gated_diag_step, "kda_step_spec": da.kda_step, "diag_step_spec": da.gated_diag_step}
INDEX_ARGS = {"cu_seqlens", "cu_seqlens_q", "cu_seqlens_k", "state_indices", "num_accepted_tokens"}


class Several(dict):
    """A case's bad value that changes several arguments together (a rule that ties them: k and v heads, A_log and
    what needs it); the case's argument is the one the message must name."""


def _with(kw, name, bad):
    """The valid keyword arguments ``kw`` with the case's bad value in place."""
    if isinstance(bad, Several):
        kw.update(bad)
    else:
        kw[name] = bad
    return kw


# ---------------------------------------------------------------------------------------------
# the catalogue: (call, argument, bad value or function of the valid value, exception, other names it may name)
# ---------------------------------------------------------------------------------------------

def _tensor_cases():
    """Every tensor argument of every call: not a tensor, a wrong dtype, a wrong rank, a wrong size, another device."""
    out = []
    for call, make in VALID.items():
        for name, x in make().items():
            if not torch.is_tensor(x):
                continue
            index = name in INDEX_ARGS
            out += [(call, name, "a list", x.tolist(), TypeError),
                    (call, name, "wrong dtype", x.to(F32 if index else I32), TypeError),
                    (call, name, "one more dim", x[None], ValueError),
                    (call, name, "another device", x.to("meta"), ValueError)]
            if x.dim() and x.shape[-1] > 1 and not (name == "v" and call != "diag" and not call.startswith("diag")):
                # (v's head dim is free in attention and KDA: V need not equal K)
                out.append((call, name, "last dim one short", x[..., :-1], ValueError))
            if not index and x.is_floating_point():
                out.append((call, name, "complex", x.to(torch.complex64), TypeError))
    return out


def _scalar_cases():
    flags = {"flash": ["causal", "deterministic", "return_attn_probs"],
             "flash_varlen": ["causal", "deterministic", "return_attn_probs"],
             "kda": ["output_final_state", "use_qk_l2norm"], "kda_step": ["use_qk_l2norm"],
             "diag": ["output_final_state"]}
    out = [(call, name, "an int for a bool", 1, TypeError) for call, names in flags.items() for name in names]
    out += [(call, name, "a None for a bool", None, TypeError) for call, names in flags.items() for name in names]
    for call in ("flash", "flash_varlen"):
        out += [(call, "softmax_scale", "inf", INF, ValueError), (call, "softmax_scale", "-inf", -INF, ValueError),
                (call, "softmax_scale", "nan", NAN, ValueError), (call, "softmax_scale", "a string", "0.1", TypeError),
                (call, "softmax_scale", "a bool", True, TypeError), (call, "softmax_scale", "a tensor", torch.tensor(0.1), TypeError),
                (call, "softcap", "inf", INF, ValueError), (call, "softcap", "nan", NAN, ValueError),
                (call, "softcap", "negative", -1.0, ValueError), (call, "softcap", "a string", "1", TypeError),
                (call, "dropout_p", "1", 1.0, ValueError), (call, "dropout_p", "negative", -0.1, ValueError),
                (call, "dropout_p", "nan", NAN, ValueError), (call, "dropout_p", "a string", "0", TypeError),
                (call, "window_size", "below -1", (-2, 0), ValueError), (call, "window_size", "an int", 3, TypeError),
                (call, "window_size", "three entries", (1, 2, 3), TypeError),
                (call, "window_size", "floats", (1.0, 0.0), TypeError), (call, "window_size", "bools", (True, 0), TypeError),
                (call, "backend", "unknown", "cuda", ValueError), (call, "backend", "None", None, ValueError)]
    out += [("flash_varlen", "max_seqlen_q", "a float", 5.0, TypeError), ("flash_varlen", "max_seqlen_k", "a bool", True, TypeError),
            ("flash_varlen", "max_seqlen_q", "below the longest", 4, ValueError),
            ("flash_varlen", "max_seqlen_k", "negative", -1, ValueError),
            ("flash_varlen", "layout", "unknown", "bshd", ValueError), ("flash_varlen", "layout", "upper case", "THD", ValueError)]
    for call in ("kda", "kda_step"):
        out += [(call, "scale", "inf", INF, ValueError), (call, "scale", "nan", NAN, ValueError),
                (call, "scale", "a string", "0.3", TypeError), (call, "scale", "a bool", False, TypeError),
                (call, "lower_bound", "positive", 1.0, ValueError), (call, "lower_bound", "zero", 0.0, ValueError),
                (call, "lower_bound", "-inf", -INF, ValueError), (call, "lower_bound", "nan", NAN, ValueError),
                (call, "lower_bound", "a bool", True, TypeError), (call, "backend", "unknown", "cudnn2", ValueError)]
    for call in ("diag", "diag_step"):
        out.append((call, "backend", "unknown", "sdpa2", ValueError))
    return out


def _value_cases():
    """Values the shapes and dtypes cannot show: cu_seqlens and state_indices contents, cross-argument rules."""
    cu = lambda *v: torch.tensor(v, dtype=I32)      # noqa: E731
    out = []
    for call, name in (("flash_varlen", "cu_seqlens_q"), ("flash_varlen", "cu_seqlens_k"), ("kda_varlen", "cu_seqlens"),
                       ("diag_varlen", "cu_seqlens")):
        out += [(call, name, "not starting at 0", cu(1, 4, 4, 9), ValueError),
                (call, name, "decreasing (a negative length)", cu(0, 6, 5, 9), ValueError),
                (call, name, "not ending at the token count", cu(0, 4, 4, 8), ValueError),
                (call, name, "beyond int32", torch.tensor([0, 2 ** 32, 4, 9]), ValueError),
                (call, name, "one entry", cu(0), ValueError), (call, name, "a bool tensor", cu(0, 4, 4, 9).bool(), TypeError)]
    out += [("flash_varlen", "cu_seqlens_k", "fewer sequences", cu(0, 9), ValueError),
            ("flash_varlen", "alibi_slopes", "(B, H) with B the batch of a dense call", torch.rand(2, 4), ValueError),
            ("flash", "alibi_slopes", "float64", torch.rand(4, dtype=torch.float64), TypeError),
            ("flash", "k", "heads not dividing q's", torch.randn(2, 7, 3, 16), ValueError),
            ("flash", "q", "no heads", torch.randn(2, 5, 0, 16), ValueError),
            ("flash", "q", "head dim 0", torch.randn(2, 5, 4, 0), ValueError),
            ("flash", "v", "another dtype", torch.randn(2, 7, 2, 16, dtype=torch.float64), TypeError),
            ("flash", "k", "another batch size", torch.randn(3, 7, 2, 16), ValueError),
            ("flash", "v", "another length than k", torch.randn(2, 6, 2, 16), ValueError),
            ("flash", "v", "other heads than k", torch.randn(2, 7, 1, 16), ValueError),
            ("flash", "k", "k and v heads not dividing q's",
             Several(k=torch.randn(2, 7, 3, 16), v=torch.randn(2, 7, 3, 16)), ValueError),
            ("flash_varlen", "alibi_slopes", "one row per sequence short", torch.rand(2, 4), ValueError),
            ("kda", "v", "value heads not a multiple of H", torch.randn(2, 5, 3, 6), ValueError),
            ("kda", "v", "another length", torch.randn(2, 4, 4, 6), ValueError),
            ("kda", "v", "float64 with float32 q", torch.randn(2, 5, 4, 6, dtype=torch.float64), TypeError),
            ("kda", "g", "float64 with float32 q", torch.randn(2, 5, 4, 8, dtype=torch.float64), TypeError),
            ("kda", "beta", "float16 with float32 q", torch.rand(2, 5, 4, dtype=torch.float16), TypeError),
            ("kda", "A_log", "float16", torch.zeros(4, dtype=torch.float16), TypeError),
            ("kda", "A_log", "None with dt_bias", None, ValueError),
            ("kda", "lower_bound", "without A_log", Several(A_log=None, dt_bias=None), ValueError),
            ("kda", "initial_state", "float16", torch.zeros(2, 4, 8, 6, dtype=torch.float16), TypeError),
            ("kda", "initial_state", "transposed (N, HV, V, K)", torch.zeros(2, 4, 6, 8), ValueError),
            ("kda", "cu_seqlens", "with batch 2", cu(0, 5), ValueError),
            ("kda_varlen", "initial_state", "one state per batch row, not per sequence", torch.zeros(1, 4, 8, 6), ValueError),
            ("kda_step", "q", "no new token", torch.randn(2, 0, 2, 8), ValueError),
            ("kda_step", "state", "bf16", torch.zeros(3, 4, 8, 6, dtype=torch.bfloat16), TypeError),
            ("kda_step", "state_indices", "out of the pool", torch.tensor([0, 3], dtype=I32), ValueError),
            ("kda_step", "state_indices", "negative", torch.tensor([-1, 0], dtype=I32), ValueError),
            ("kda_step", "state_indices", "a repeated slot", torch.tensor([1, 1], dtype=I32), ValueError),
            ("kda_step", "state_indices", "one per pool slot, not per sequence", torch.tensor([0, 1, 2], dtype=I32), ValueError),
            ("kda_step", "state_indices", "None with a larger pool", None, ValueError),
            ("diag", "g", "float64 with float32 q", torch.randn(2, 5, 3, 8, dtype=torch.float64), TypeError),
            ("diag", "k", "float16 with float32 q", torch.randn(2, 5, 3, 8, dtype=torch.float16), TypeError),
            ("diag", "q", "no heads", torch.randn(2, 5, 0, 8), ValueError),
            ("diag", "initial_state", "float16", torch.zeros(2, 3, 8, dtype=torch.float16), TypeError),
            ("diag", "cu_seqlens", "with batch 2", cu(0, 5), ValueError),
            ("diag_varlen", "initial_state", "one state for three sequences", torch.zeros(1, 3, 8), ValueError),
            ("diag_step", "q", "no new token", torch.randn(2, 0, 3, 8), ValueError),
            ("diag_step", "state", "float16", torch.zeros(3, 3, 8, dtype=torch.float16), TypeError),
            ("diag_step", "state_indices", "out of the pool", torch.tensor([3, 0]), ValueError),
            ("diag_step", "state_indices", "negative", torch.tensor([-1, 2]), ValueError),
            ("diag_step", "state_indices", "a repeated slot", torch.tensor([2, 2]), ValueError),
            ("diag_step", "state_indices", "None with a larger pool", None, ValueError),
            ("kda_step", "num_accepted_tokens", "with (B,) state_indices", torch.tensor([1, 1], dtype=I32), ValueError),
            ("diag_step", "num_accepted_tokens", "with (B,) state_indices", torch.tensor([1, 1]), ValueError)]
    for call in ("kda_step_spec", "diag_step_spec"):
        out += [(call, "num_accepted_tokens", "0 (the first token is always kept)", torch.tensor([0, 2], dtype=I32),
                 ValueError),
                (call, "num_accepted_tokens", "above T", torch.tensor([6, 1], dtype=I32), ValueError),
                (call, "state_indices", "a slot repeated across tokens", torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 0]],
                                                                                      dtype=I32), ValueError),
                (call, "state_indices", "out of the pool", torch.arange(1, 11, dtype=I32).view(2, 5), ValueError)]
    return out


CATALOGUE = _tensor_cases() + _scalar_cases() + _value_cases()
# what else a message may name when one argument is wrong (the rule it breaks ties it to another argument)
RELATED = {"A_log": ("dt_bias", "lower_bound"), "q": ("k",), "dt_bias": ("A_log",), "lower_bound": ("A_log",),
           "alibi_slopes": ("heads",), "cu_seqlens": ("batch",)}
# how a refusal is worded, where the wording says more than the argument's name: (call, argument, case) -> regex
WORDING = {
    ("flash", "q", "one more dim"): r"q must be 4-D",
    ("flash", "q", "a list"): r"q must be a torch\.Tensor",
    ("flash", "k", "another batch size"): r"k batch size",
    ("flash", "v", "another length than k"): r"v sequence length",
    ("flash", "v", "other heads than k"): r"v heads",
    ("flash", "k", "last dim one short"): r"k head dim must equal q",
    ("flash", "k", "k and v heads not dividing q's"): r"q heads \(4\) must be a multiple of k heads \(3\)",
    ("flash", "v", "another dtype"): r"v must have the dtype of q",
    ("flash", "q", "wrong dtype"): r"q must be float16",
    ("flash", "v", "another device"): r"v must be on the device of q",
    ("flash", "window_size", "below -1"): r"window_size entries must be >= -1",
    ("flash", "window_size", "an int"): r"window_size must be a pair",
    ("flash", "softcap", "negative"): r"softcap must be >= 0",
    ("flash", "softcap", "inf"): r"softcap must be a finite number >= 0",
    ("flash", "softcap", "nan"): r"softcap must be a finite number",
    ("flash", "softmax_scale", "inf"): r"softmax_scale must be a finite number, got inf",
    ("flash", "softmax_scale", "-inf"): r"softmax_scale must be a finite number, got -inf",
    ("flash", "softmax_scale", "nan"): r"softmax_scale must be a finite number, got nan",
    ("flash", "softmax_scale", "a string"): r"softmax_scale must be a number",
    ("flash", "dropout_p", "1"): r"dropout_p must be in \[0\.0, 1\.0\)",
    ("flash", "dropout_p", "a string"): r"dropout_p must be a number",
    ("flash", "alibi_slopes", "last dim one short"): r"alibi_slopes must have shape \(4,\) or \(2, 4\)",
    ("flash", "alibi_slopes", "float64"): r"alibi_slopes must be float32",
    ("flash", "causal", "an int for a bool"): r"causal must be a bool",
    ("flash", "backend", "unknown"): r"backend must be one of",
    ("flash_varlen", "cu_seqlens_q", "wrong dtype"): r"cu_seqlens_q must be int32 or int64, got torch\.float32",
    ("flash_varlen", "cu_seqlens_q", "beyond int32"): r"cu_seqlens_q values must fit int32",
    ("flash_varlen", "cu_seqlens_k", "one more dim"): r"cu_seqlens_k must be 1-D",
    ("flash_varlen", "cu_seqlens_q", "not starting at 0"): r"cu_seqlens_q must start at 0",
    ("flash_varlen", "cu_seqlens_q", "decreasing (a negative length)"): r"non-decreasing",
    ("flash_varlen", "cu_seqlens_k", "not ending at the token count"):
        r"cu_seqlens_k\[-1\] must equal the number of packed tokens \(9\)",
    ("flash_varlen", "cu_seqlens_k", "fewer sequences"): r"as many sequences",
    ("flash_varlen", "max_seqlen_q", "below the longest"): r"max_seqlen_q must be >= the longest sequence",
    ("flash_varlen", "max_seqlen_q", "a float"): r"max_seqlen_q must be an int",
    ("flash_varlen", "q", "one more dim"): r"q must be 3-D",
    ("flash_varlen", "layout", "unknown"): r"layout must be one of 'thd', 'htd'",
    ("flash_varlen", "softmax_scale", "inf"): r"softmax_scale must be a finite number",
    ("flash_varlen", "softmax_scale", "nan"): r"softmax_scale must be a finite number",
    ("flash_varlen", "softcap", "inf"): r"softcap must be a finite number",
    ("flash_varlen", "alibi_slopes", "one row per sequence short"): r"alibi_slopes must have shape",
    ("kda", "q", "one more dim"): r"q must be 4-D",
    ("kda", "k", "last dim one short"): r"k must have shape \(2, 5, 2, 8\)",
    ("kda", "v", "another length"): r"v batch and length",
    ("kda", "v", "value heads not a multiple of H"):
        r"value heads HV \(v\.shape\[2\]\) \(3\) must be a multiple of query heads H",
    ("kda", "g", "last dim one short"): r"g must have shape \(2, 5, 4, 8\)",
    ("kda", "beta", "last dim one short"): r"beta must have shape \(2, 5, 4\)",
    ("kda", "v", "float64 with float32 q"): r"v must have the dtype of q",
    ("kda", "g", "float64 with float32 q"): r"g must have the dtype of q",
    ("kda", "beta", "another device"): r"beta must be on the device",
    ("kda", "initial_state", "transposed (N, HV, V, K)"): r"initial_state must have shape \(2, 4, 8, 6\)",
    ("kda", "initial_state", "float16"): r"initial_state must be float32 or float64",
    ("kda", "cu_seqlens", "with batch 2"): r"with cu_seqlens the batch must be packed into B == 1",
    ("kda_varlen", "initial_state", "one state per batch row, not per sequence"):
        r"initial_state must have shape \(3, 4, 8, 6\)",
    ("kda", "A_log", "None with dt_bias"): r"dt_bias needs A_log",
    ("kda", "lower_bound", "without A_log"): r"lower_bound needs A_log",
    ("kda", "A_log", "last dim one short"): r"A_log must have shape \(4,\)",
    ("kda", "dt_bias", "one more dim"): r"dt_bias must be 1-D",
    ("kda", "lower_bound", "positive"): r"lower_bound must be a finite number < 0",
    ("kda", "backend", "unknown"): r"backend must be one of",
    ("kda_step", "state", "last dim one short"): r"state must have shape",
    ("kda_step", "state", "bf16"): r"state must be float32 or float64",
    ("kda_step", "state_indices", "out of the pool"): r"state_indices must lie in \[0, 3\)",
    ("kda_step", "state_indices", "a repeated slot"): r"must not repeat",
    ("kda_step", "state_indices", "wrong dtype"): r"state_indices must be int32 or int64",
    ("kda_step", "state_indices", "None with a larger pool"): r"one slot per sequence",
    ("diag", "q", "one more dim"): r"q must be 4-D",
    ("diag", "v", "last dim one short"): r"v must have shape \(2, 5, 3, 8\)",
    ("diag", "g", "last dim one short"): r"g must have shape",
    ("diag", "k", "float16 with float32 q"): r"k must have the dtype of q",
    ("diag", "g", "another device"): r"g must be on the device",
    ("diag", "initial_state", "last dim one short"): r"initial_state must have shape \(2, 3, 8\)",
    ("diag", "initial_state", "float16"): r"initial_state must be float32",
    ("diag", "cu_seqlens", "with batch 2"): r"packed into B == 1",
    ("diag_step", "state_indices", "out of the pool"): r"state_indices must lie in \[0, 3\)",
    ("diag_step", "state_indices", "negative"): r"state_indices must lie in \[0, 3\)",
    ("diag_step", "state", "one more dim"): r"state must be 3-D",
}


@pytest.fixture
def no_launch(monkeypatch):
    """Every backend's implementation fails the test if dispatch reaches it."""
    class Boom:
        def __getattr__(self, op):
            raise AssertionError(f"dispatch reached an implementation of {op} before the bad input was refused")

    for b in backends.BACKENDS.values():
        monkeypatch.setattr(b, "implementation", lambda op: Boom().__getattr__(op))
        monkeypatch.setattr(b, "loaded", Boom())


@pytest.mark.parametrize("call,name,what,bad,exc", CATALOGUE,
                         ids=[f"{c}-{n}-{w}" for c, n, w, _, _ in CATALOGUE])
def test_bad_input_is_refused_by_name_before_any_launch(call, name, what, bad, exc, no_launch):
    kw = _with(dict(VALID[call](), backend="torch"), name, bad)
    with pytest.raises(exc) as err:
        FN[call](**kw)
    assert not isinstance(err.value, UnsupportedError), f"a capability refusal, not validation: {err.value}"
    names = (name,) + RELATED.get(name, ())
    assert any(re.search(rf"\b{re.escape(n)}\b", str(err.value)) for n in names), \
        f"the message does not name {name}: {err.value}"
    wording = WORDING.get((call, name, what))
    assert wording is None or re.search(wording, str(err.value)), f"not worded as {wording!r}: {err.value}"


def test_every_wording_belongs_to_a_case():
    assert set(WORDING) <= {(c, n, w) for c, n, w, _, _ in CATALOGUE}


@pytest.mark.parametrize("call", list(VALID))
def test_valid_templates_pass_validation(call, monkeypatch):
    """The templates are valid: each error above comes from the one argument the case changed."""
    ran = []
    for b in backends.BACKENDS.values():
        monkeypatch.setattr(b, "implementation", lambda op: None)
        monkeypatch.setattr(b, "loaded", type("Stub", (), {"__getattr__": lambda self, op: lambda a: ran.append(op) or (None, None)})())
    FN[call](**VALID[call](), backend="torch")
    assert ran


def test_explain_validates_like_the_call():
    """da.explain runs the same validation: a bad input raises the same error from explain."""
    for call, name, what, bad, exc in CATALOGUE[::7]:
        kw = _with(VALID[call](), name, bad)
        kw.pop("backend", None)
        with pytest.raises(exc):
            da.explain(FN[call], **kw)


# ---------------------------------------------------------------------------------------------
# accepted: the call runs and gives the reference's result (tests/properties.py's check)
# ---------------------------------------------------------------------------------------------

def _first(op, want, n=400):
    """The first CPU configuration of ``op`` for which ``want(case)`` holds (a deterministic search)."""
    return next(c for c in (P.draw(op, s) for s in range(n)) if want(c))


def _accepted():
    var = lambda c: sum(1 for n in c.p.get("lens_q") or () if n == 0) and c.dtype == "fp16" and c.p["d"] % 8 == 0 \
        and c.p["dv"] == c.p["d"] and not c.grad      # noqa: E731
    flash_v = _first("flash_varlen", var)
    kda_v = _first("kda", lambda c: c.p["kda"].cu is not None and 0 in [b - a for a, b in zip(c.p["kda"].cu, c.p["kda"].cu[1:])]
                   and c.dtype == "fp16" and c.nan is None)
    diag_v = _first("diag", lambda c: c.p["lens"] is not None and 0 in c.p["lens"] and c.nan is None and c.dtype == "fp16")
    step = lambda op: _first(op, lambda c: c.p["indices"] is not None and c.p["pool"] > c.p["b"] and c.nan is None  # noqa: E731
                             and c.dtype in ("fp16", "fp32") and not c.grad)
    kstep, dstep = step("kda_step"), step("diag_step")
    cases = []
    for kind in ("step", "pad", "swap"):
        cases += [(f"strided cu_seqlens_q / cu_seqlens_k ({kind})",
                   replace(flash_v, strided={"cu_seqlens_q": kind, "cu_seqlens_k": kind}, p={**flash_v.p, "same_cu": False})),
                  (f"strided cu_seqlens, kda ({kind})", replace(kda_v, strided={"cu_seqlens": kind})),
                  (f"strided cu_seqlens, diag ({kind})", replace(diag_v, strided={"cu_seqlens": kind})),
                  (f"strided state_indices, kda_step ({kind})", replace(kstep, strided={"state_indices": kind})),
                  (f"strided state_indices, diag_step ({kind})", replace(dstep, strided={"state_indices": kind}))]
    cases += [("int64 cu_seqlens, flash varlen", replace(flash_v, p={**flash_v.p, "cu_dtype": "int64"})),
              ("int64 state_indices, kda_step", replace(kstep, p={**kstep.p, "indices": "int64"})),
              ("int32 state_indices, diag_step", replace(dstep, p={**dstep.p, "indices": "int32"})),
              ("float32 g and beta with fp16 q / k / v", replace(kda_v, p={**kda_v.p, "kda": replace(kda_v.p["kda"], fp32_gb=True)})),
              ("float32 g with fp16 q / k / v, diag", replace(diag_v, p={**diag_v.p, "g32": True})),
              ("strided A_log and dt_bias", replace(_first("kda", lambda c: c.p["kda"].gate is not None and c.dtype == "fp16"),
                                                    strided={"A_log": "step", "dt_bias": "pad"}))]
    return cases


ACCEPTED = _accepted()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("what,case", ACCEPTED, ids=[w for w, _ in ACCEPTED])
def test_accepted_input_gives_the_reference_result(what, case, backend):
    checker = P.Checker(case, "cpu")
    assert checker.runs(backend), f"{backend} should run {what}"
    assert checker.check(backend) == "ran"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_max_seqlen_above_the_longest_sequence_is_accepted(backend):
    kw = _varlen()
    kw.update(q=kw["q"].half(), k=kw["k"].half(), v=kw["v"].half(), max_seqlen_q=40, max_seqlen_k=7, softcap=0.0,
              alibi_slopes=None)
    out = da.flash_attn_varlen_func(**kw, backend=backend)
    want = da.flash_attn_varlen_func(**{**kw, "max_seqlen_q": 5, "max_seqlen_k": 5}, backend=backend)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batches_are_accepted(backend):
    """B = 0 / T = 0 / Sk = 0: empty (or zero, lse +inf) results, not errors."""
    x = torch.randn(0, 5, 2, 16, dtype=torch.float16)
    assert da.flash_attn_func(x, x, x, backend=backend).shape == (0, 5, 2, 16)
    q, kv = torch.randn(1, 5, 2, 16, dtype=torch.float16), torch.randn(1, 0, 2, 16, dtype=torch.float16)
    out, lse, _ = da.flash_attn_func(q, kv, kv, return_attn_probs=True, backend=backend)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == INF).all())
    y = torch.randn(2, 0, 2, 16)
    o, s = da.gated_diag_attn(y, y, y, y, initial_state=torch.ones(2, 2, 16), output_final_state=True, backend=backend)
    assert o.shape == y.shape and torch.equal(s, torch.ones(2, 2, 16))
    o, s = da.kda(y, y, y, y, torch.rand(2, 0, 2), initial_state=torch.ones(2, 2, 16, 16), output_final_state=True,
                  backend=backend)
    assert o.shape == y.shape and torch.equal(s, torch.ones(2, 2, 16, 16))


@pytest.mark.parametrize("scale", [-0.3, -10.0, 1e-30, 7])
def test_any_finite_softmax_scale_is_accepted(scale):
    """Any finite scale (negative, tiny, an int) runs and gives a finite result (docs/CONTRACT.md)."""
    assert torch.isfinite(da.flash_attn_func(**dict(_flash(), softmax_scale=scale), backend="torch")).all()
    assert torch.isfinite(da.flash_attn_varlen_func(**dict(_varlen(), softmax_scale=scale, softcap=2.5),
                                                    backend="torch")).all()


# ---------------------------------------------------------------------------------------------
# the checks themselves
# ---------------------------------------------------------------------------------------------

def test_validation_runs_before_any_backend(monkeypatch):
    """A bad input is refused before the registry is even asked for a backend."""
    ran = []
    monkeypatch.setattr(backends, "select", lambda *a, **k: ran.append(1))
    with pytest.raises(ValueError):
        da.flash_attn_func(**dict(_flash(), softcap=-1.0), backend="torch")
    assert ran == []


@pytest.mark.parametrize("bad", [dict(softmax_scale=INF), dict(softmax_scale=NAN)])
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
        C.number("x", NAN)
    with pytest.raises(ValueError, match=r"x must be a finite number in \[0, 1\], got inf"):
        C.number("x", INF, 0, 1, finite=True)
    C.number("x", INF)                                # without finite=True, inf stays allowed


def test_value_checks_can_be_skipped_to_stay_asynchronous(monkeypatch):
    """DELTA_ATTN_SKIP_VALUE_CHECKS=1 drops only the checks that read device values on the host."""
    monkeypatch.setenv("DELTA_ATTN_SKIP_VALUE_CHECKS", "1")
    from delta_attn.ops.flash.api import validate_varlen
    kw = _varlen()
    decreasing = torch.tensor([0, 6, 5, 9], dtype=I32)
    validate_varlen(**dict(kw, cu_seqlens_q=decreasing, cu_seqlens_k=decreasing.clone()))   # values: not read
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32 or int64"):
        validate_varlen(**dict(kw, cu_seqlens_q=torch.tensor([0., 4., 4., 9.])))


def test_value_checks_are_skipped_under_cuda_graph_capture(monkeypatch):
    """A host read of state_indices cannot be captured in a CUDA graph: under capture the value checks are off
    (bad indices then go unchecked, as with DELTA_ATTN_SKIP_VALUE_CHECKS=1); outside capture they run."""
    from delta_attn import _checks
    bad = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="state_indices must lie in"):
        _checks.state_indices(bad, 2, 4, bad.device)
    monkeypatch.setattr(_checks, "_capturing", lambda: True)
    _checks.state_indices(bad, 2, 4, bad.device)
