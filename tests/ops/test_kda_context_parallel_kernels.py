"""The Triton KDA's context-parallel stages on one process (fp32, IEEE dots; the interpreter on CPU, the GPU when
there is one):
``ops/kda/launch_carry.py``'s ``cp_forward`` (the transition scan of the carried rows), ``cp_fold_carry`` (the carry
added to outputs, final states and the backward's saved tensors) and ``cp_carry_grad``, against the float64
reference and against the plain forward at the true initial state. Both scan layouts of a chunk (whole, and
two row halves: ``SPLIT``), dense (every row carried) and packed (the first piece carried), with and without
gradients. The operator on several ranks: tests/distributed/test_distributed_linear.py."""
import pytest
import torch

from delta_attn import reference
from delta_attn.ops.kda import launch, launch_carry

pytest.importorskip("triton")

B, T, H, HV, K, V = 2, 70, 1, 2, 16, 32          # 70 tokens: a carried row over two 64-token chunks
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(b, t, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, H, K, generator=gen) for _ in range(2))
    v = torch.randn(b, t, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(b, t, HV, K, generator=gen) + 2.0)
    beta = torch.rand(b, t, HV, generator=gen)
    return [x.to(DEV) for x in (q, k, v, g, beta)]


def _forward(x, init, cu, train, carried, carried_len):
    b, t = x[0].shape[:2]
    tables = {}

    def chunks(bt):
        if bt not in tables:
            tables[bt] = launch.chunk_tables(b, t, None if cu is None else cu.tolist(), DEV, bt)
        return tables[bt]

    return launch_carry.cp_forward(*x, init, cu, None, None, K ** -0.5, None, True, False, train, chunks, carried,
                             carried_len)


def _split_scan(monkeypatch):
    """Every scan of 64-token chunks walks them as two row halves (SPLIT 2), the layout of large fp32 tiles on a
    GPU (as ``scan_tiles``, not for shorter chunks)."""
    plain = launch.scan_tiles

    def halves(K, V, chains, bt, *a):
        return tuple(t.with_(SPLIT=2) if bt >= 32 else t for t in plain(K, V, chains, bt, *a))
    monkeypatch.setattr(launch, "scan_tiles", halves)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_transition_fold_and_carry_gradient(monkeypatch, split, train, packed):
    if split:
        _split_scan(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    if packed:      # the carried first piece (75 tokens: two chunks), then a sequence that starts here
        x, cu = _inputs(1, 100), torch.tensor([0, 75, 100], dtype=torch.int32, device=DEV)
        carried, t1, rows = 1, 75, 2
        h0 = torch.randn(rows, HV, K, V, generator=gen).to(DEV)
        init = torch.cat([torch.zeros_like(h0[:1]), h0[1:]])
    else:
        x, cu = _inputs(B, T), None
        carried, t1, rows, init = B, T, B, None
    o, final, saved, tr = _forward(x, init, cu, train, carried, t1)
    # the transition: the reference with zero values and the identity as initial state, on the carried rows
    first = [t[:carried, :t1].double() for t in x]
    first[2] = torch.zeros(carried, t1, HV, K, dtype=torch.float64, device=DEV)
    eye = torch.eye(K, dtype=torch.float64, device=DEV).expand(carried, HV, K, K)
    u_ref, m_ref = reference.kda(*first, initial_state=eye, output_final_state=True, use_qk_l2norm=True)
    torch.testing.assert_close(tr.u.view(carried, t1, HV, K).double(), u_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tr.m.double(), m_ref, rtol=1e-5, atol=1e-5)
    assert (tr.HS is not None) == train and (tr.VNEW is not None) == train
    # the carry folded in: what the plain forward at the true initial state computes and keeps
    carry = torch.randn(carried, HV, K, V, generator=gen).to(DEV)
    launch_carry.cp_fold_carry(o, final, saved, tr, carry, False)
    true_init = carry if init is None else torch.cat([carry, init[1:]])
    o_want, f_want, s_want = launch._forward(*x, true_init, cu, None, None, K ** -0.5, None, True, True, False, train,
                                             keep_operands=True)
    torch.testing.assert_close(o, o_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, f_want, rtol=1e-5, atol=1e-5)
    if train:
        torch.testing.assert_close(saved.VNEW, s_want.VNEW, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(saved.HS, s_want.HS, rtol=1e-5, atol=1e-5)
    # the carry's gradient from the outputs: sum_t u_t^T do_t over the carried rows (do with a stride)
    do = torch.randn(x[2].shape[0], x[2].shape[1], HV, 2 * V, generator=gen).to(DEV)[..., ::2]
    want = torch.einsum("bthk,bthv->bhkv", u_ref, do[:carried, :t1].double())
    got = launch_carry.cp_carry_grad(tr.u, do, carried, torch.float32, False)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
