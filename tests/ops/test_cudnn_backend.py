"""CPU tests of the cudnn / sdpa backends: capabilities, reasons, explicit-backend errors, the auto
policy (device properties faked), and the host-side ragged metadata (empty rows, buckets)."""
import pytest
import torch

import delta_attn as da
from delta_attn import backends as B
from delta_attn import reference
from delta_attn.backends import Call, UnsupportedError, auto_order, explain_call
from delta_attn.ops.flash import cudnn as C

CUDA = torch.device("cuda", 0)


def _call(op="flash", dtype=torch.bfloat16, dims=(128, 128), feats=(), grad=False):
    return Call(op=op, device=CUDA, dtype=dtype, head_dims=dims, features=frozenset(feats), needs_grad=grad)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen compute capability, cuDNN 9.19, frontend installed or not."""
    state = {"cc": (9, 0), "frontend": True}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(B, "device_capability", lambda dev: state["cc"] if dev.type == "cuda" else None)
    real = B.package_available
    monkeypatch.setattr(B, "package_available", lambda m: state["frontend"] if m == "cudnn" else real(m))
    monkeypatch.setattr(C, "torch_cudnn_version", lambda: 91900)
    monkeypatch.setattr(C, "frontend_error", lambda: None)
    return state


def reasons(backend, call):
    return B.BACKENDS[backend].not_supported_reasons(call)


def test_plain_calls_supported_on_hopper(fake_gpu):
    assert reasons("cudnn", _call()) == []
    assert reasons("cudnn", _call("flash_varlen", feats={"varlen", "causal", "gqa", "layout_htd"}, grad=True)) == []
    assert reasons("sdpa", _call(feats={"causal", "window", "gqa", "sq_ne_sk"})) == []
    assert reasons("sdpa", _call("flash_varlen", feats={"varlen", "layout_htd", "window"})) == []


def test_dense_graph_features_need_frontend(fake_gpu):
    fake_gpu["frontend"] = False
    assert reasons("cudnn", _call(feats={"causal"})) == []          # SDPA cuDNN route: no frontend needed
    r = reasons("cudnn", _call(feats={"window"}))
    assert any("nvidia-cudnn-frontend not installed" in x and "pip install" in x for x in r), r
    r = reasons("cudnn", _call(feats={"causal", "sq_ne_sk"}))
    assert any("causal with Sq != Sk" in x for x in r), r
    assert reasons("cudnn", _call(feats={"sq_ne_sk"})) == []        # non-causal Sq != Sk is fine in SDPA
    r = reasons("cudnn", _call("flash_varlen", feats={"varlen"}))
    assert any("cudnn not installed — pip install --no-deps 'nvidia-cudnn-frontend>=1.32' && pip install cuda-python"
               in x for x in r), r


def test_unsupported_features_and_dims_are_named(fake_gpu):
    r = reasons("cudnn", _call(feats={"softcap", "alibi", "dropout"}))
    assert any("does not support alibi, dropout, softcap" in x for x in r), r
    assert any("multiples of 8 and at most 128" in x for x in reasons("cudnn", _call(dims=(256, 256))))
    assert reasons("cudnn", _call(dims=(96, 96))) == []
    assert any("equal q/k and v head dims" in x for x in reasons("sdpa", _call(dims=(64, 128), feats={"head_dim_v"})))
    assert any("float16, bfloat16" in x for x in reasons("cudnn", _call(dtype=torch.float32)))
    # float32 goes to the memory-efficient kernel, which is top-left causal
    r = reasons("sdpa", _call(dtype=torch.float32, feats={"causal", "sq_ne_sk"}))
    assert any("top-left" in x for x in r), r
    assert reasons("sdpa", _call(dtype=torch.float32, feats={"causal"})) == []
    assert any("float32 varlen" in x for x in reasons("sdpa", _call("flash_varlen", torch.float32, feats={"varlen"})))


def test_compute_capability_reasons(fake_gpu):
    fake_gpu["cc"] = (8, 0)
    r = reasons("cudnn", _call("flash_varlen", feats={"varlen"}))
    assert any("compute capability >= 9.0" in x and "8.0" in x for x in r), r
    assert reasons("cudnn", _call(feats={"causal"})) == []
    assert any("compute capability >= 9.0" in x for x in reasons("cudnn", _call(feats={"gqa"})))
    fake_gpu["cc"] = (7, 5)
    assert any(">= 8.0" in x for x in reasons("sdpa", _call()))


def test_auto_policy_order_by_architecture(fake_gpu):
    assert auto_order(_call())[:3] == ("cudnn", "triton", "sdpa")
    assert auto_order(_call("flash_varlen", feats={"varlen"}))[:3] == ("cudnn", "triton", "sdpa")
    fake_gpu["cc"] = (8, 6)
    assert auto_order(_call())[:3] == ("cudnn", "sdpa", "triton")
    # on CPU the policy keeps the registry's default order
    cpu = Call(op="flash", device=torch.device("cpu"), dtype=torch.float32, head_dims=(16, 16))
    assert auto_order(cpu) == B._DEFAULT_ORDER["flash"] + tuple(n for n in B.BACKENDS if n not in B._DEFAULT_ORDER["flash"])


def test_auto_explains_choice_and_skips_unusable(fake_gpu):
    ex = explain_call(_call(feats={"causal"}), "auto")
    assert ex.chosen == "cudnn"
    text = str(ex)
    assert "policy: sm90+" in text and "chosen: cudnn" in text
    fake_gpu["frontend"] = False
    ex = explain_call(_call("flash_varlen", feats={"varlen", "causal"}), "auto")
    assert ex.chosen != "cudnn"
    assert "cudnn: passed over" in str(ex) and "not installed" in str(ex)
    # softcap: neither cudnn nor sdpa can run it
    ex = explain_call(_call(feats={"softcap"}), "auto")
    assert ex.chosen not in ("cudnn", "sdpa")


def test_explicit_backend_error_lists_reasons():
    q = torch.randn(1, 9, 2, 16)
    with pytest.raises(UnsupportedError) as e:
        da.flash_attn_func(q, q, q, softcap=5.0, backend="cudnn")
    msg = str(e.value)
    assert "backend 'cudnn' cannot run" in msg and "runs on cuda tensors, got cpu" in msg
    assert "does not support softcap" in msg and "float32" in msg
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="sdpa"):      # softcap: no SDPA kernel computes it
        da.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 5, 5, softcap=5.0, backend="sdpa")


def test_bounds_mapping():
    assert C._bounds((-1, 0), 512) == (None, 0)
    assert C._bounds((-1, -1), 512) == (None, None)
    assert C._bounds((32, 0), 512) == (33, 0)
    assert C._bounds((16, 8), 512) == (17, 8)
    assert C._bounds((8, -1), 512) == (9, 512)      # a left bound needs a right one: "unbounded" = max Sk


def test_buckets_are_few_and_tight():
    seen = set()
    for n in range(1, 70000, 7):
        b = C.bucket_len(n)
        assert b >= n and b <= max(64, n * 1.125 + 64)
        seen.add(b)
    assert len(seen) < 80
    assert [C.bucket_batch(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (4, 2), (3, 0), (2, -1)])
def test_prepare_marks_exactly_the_rows_that_see_no_key(window):
    lq, lk = [17, 0, 9, 1, 20, 7, 5], [5, 17, 3, 0, 20, 13, 5]
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    m = C._prepare(cu_q, cu_k, sum(lq), sum(lk), window[1], 8, None)
    want = torch.cat([~reference.attention_mask(a, b, window_size=window).any(-1) if a else torch.zeros(0, dtype=torch.bool)
                      for a, b in zip(lq, lk)])
    got = m.empty_q if m.empty_q is not None else torch.zeros(sum(lq), dtype=torch.bool)
    assert torch.equal(got, want)
    # cuDNN computes the remaining rows: lengths and starts are consistent, padding sequences are empty
    n_empty = torch.tensor([int(w.sum()) for w in torch.split(want, lq)])
    assert m.slq[:7].tolist() == (torch.tensor(lq) - n_empty).tolist() and m.slq[7:].tolist() == [0]
    assert m.q_start[:7].tolist() == (cu_q[:-1] + n_empty).tolist() and m.q_start[7:].tolist() == [sum(lq)] * 2
    assert m.offsets("q", 3).tolist() == (m.q_start * 3).tolist()
    dead = torch.cat([torch.full((b,), a - int(e) == 0) for a, b, e in zip(lq, lk, n_empty)])
    assert torch.equal(m.dead_k, dead)


def test_prepare_same_cu_has_no_empty_rows_and_is_memoised():
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    m = C._prepare(cu, cu, 10, 10, 0, 4, None)
    assert m.empty_q is None and m.slq.tolist() == [3, 0, 7, 0]
    assert C._prepare(cu, cu, 10, 10, 0, 4, None) is m
    cu.add_(0)                                        # in-place write bumps the version: recomputed
    assert C._prepare(cu, cu, 10, 10, 0, 4, None) is not m


def test_env_renders_install_hint_without_frontend():
    from delta_attn.env import collect, render
    text = render(collect())
    assert "nvidia-cudnn-frontend: not installed — pip install --no-deps 'nvidia-cudnn-frontend>=1.32'" in text


def test_policy_reads_the_measured_table_per_training(fake_gpu, monkeypatch):
    monkeypatch.setitem(B.ATTENTION_SM90_ORDER, ("flash_varlen", True), ("sdpa", "cudnn", "triton", "torch"))
    assert auto_order(_call("flash_varlen", feats={"varlen"}, grad=True))[:2] == ("sdpa", "cudnn")
    assert auto_order(_call("flash_varlen", feats={"varlen"}, grad=False))[0] == "cudnn"
    assert "forward+backward" in str(explain_call(_call("flash_varlen", feats={"varlen"}, grad=True)))


def test_lse_from_stats_marks_empty_rows_without_touching_stats():
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 4], dtype=torch.int32)          # sequence 0 has no key
    m = C._prepare(cu_q, cu_k, 5, 4, 0, 2, None)
    stats = torch.arange(10, dtype=torch.float32).view(5, 2)
    lse = C._lse_from_stats(stats, m)
    assert lse.shape == (2, 5)
    assert torch.isinf(lse[:, :3]).all() and torch.equal(lse[:, 3:], stats[3:].t())
    assert torch.isfinite(stats).all()
