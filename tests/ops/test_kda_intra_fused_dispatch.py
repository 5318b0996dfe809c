"""Which training forwards take the Gluon intra-chunk kernel (``launch._train_intra_fused_unsupported``), checked on
CPU with the GPU facts patched in: the same reason as the Gluon backward's for every call (whose every condition
tests/ops/test_kda_bwd_fused_dispatch.py checks); on CPU the Triton kernel runs alone. The Triton kernel's
``ONLY_FLAGGED`` launch, which follows the Gluon one on the GPU, is checked here in the interpreter: the flagged
(chunk, value head) pairs come out bit for bit as its full launch writes them, the others are left as they were.
The Gluon kernel itself is tested on an sm_90 GPU (tests/gpu/test_kda_intra_fused_gpu.py)."""
import pytest
import torch

from delta_attn.ops import _launch
from delta_attn.ops.kda import launch

CUDA = torch.device("cuda", 0)
OUTPUTS = ("W", "U", "QG", "KD", "AQK", "GC", "TM")


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(launch, "gluon_available", lambda device: True)
    monkeypatch.setattr(launch, "gluon_version", lambda: launch.FUSED_TRITON)
    monkeypatch.setattr(launch, "device_capability", lambda device: (9, 0))
    if launch._kda_train_intra_fused_kernel is None:
        pytest.skip("the installed Triton has no Gluon")


def _args(dtype=torch.bfloat16, K=128, V=128, g_dtype=torch.float32, beta_dtype=torch.float32, A_log=None,
          dt_bias=None, lower_bound=None, allow_tf32=False, device=CUDA):
    q = torch.empty(1, 1, 2, K, dtype=dtype)
    v = torch.empty(1, 1, 4, V, dtype=dtype)
    g = torch.empty(1, 1, 4, K, dtype=g_dtype)
    beta = torch.empty(1, 1, 4, dtype=beta_dtype)
    prec = launch.precision(dtype, allow_tf32, K, train=True)
    return q, v, g, beta, A_log, dt_bias, lower_bound, prec, device


def _call(**case):
    return launch._train_intra_fused_unsupported(*_args(**case))


def test_same_domain_as_the_gluon_backward(hopper):
    """One validation for both Gluon kernels of the training pipeline: the same reason for every call."""
    for case in (dict(), dict(dtype=torch.float16), dict(K=64), dict(g_dtype=torch.bfloat16),
                 dict(A_log=torch.zeros(4)), dict(device=torch.device("cpu"))):
        assert _call(**case) == launch._bwd_intra_fused_unsupported(*_args(**case))


def _intra_launch(monkeypatch, cu, HV=2, K=16, V=16, T=150):
    """The training forward on CPU with K = V = 16 (every pair factored or not, as the inputs say): the recorded
    launches of the intra-chunk kernel, each with copies of its arguments taken right after it ran."""
    runs = []
    real = _launch._run

    def spy(p):
        chosen = real(p)
        if getattr(p.kernel, "fn", p.kernel).__name__ == "_kda_train_intra_kernel":
            runs.append((p, {n: (a.clone() if torch.is_tensor(a) else a) for n, a in zip(p.kernel.arg_names, p.args)}))
        return chosen
    monkeypatch.setattr(_launch, "_run", spy)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, T, 1, K, generator=gen)
    k = torch.randn(1, T, 1, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, K, generator=gen) + 2.0)
    g[0, 45, 1, :4] = -1e4                          # the first chunk of head 1 decays strongly: its safe path
    beta = torch.rand(1, T, HV, generator=gen)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    launch.train_forward(q, k, v, g, beta, None, cu_t, None, None, K ** -0.5, None, True, True, True)
    return runs


def test_only_flagged_launch_redoes_the_flagged_pairs_alone(monkeypatch):
    runs = _intra_launch(monkeypatch, (0, 100, 150))
    assert len(runs) == 1
    p, full = runs[0]
    assert p.fixed["ONLY_FLAGGED"] is False
    NC, HV = full["chunk_info"].shape[0], full["HV"]
    flags = torch.zeros(NC, HV, dtype=torch.int32)
    flags[0, 1] = flags[1, 0] = flags[2, 1] = 1     # the strong decay's pair, a short last chunk, the 2nd sequence
    bufs = {n: torch.full_like(full[n], -7.0) for n in OUTPUTS}
    args = tuple(flags if n == "FLAGS" else bufs.get(n, full[n]) for n in p.kernel.arg_names[:len(p.args)])
    _launch.launch(p.kernel, p.grid, args, dict(p.fixed, ONLY_FLAGGED=True), p.candidates)
    for c, (_, row0, L) in enumerate(full["chunk_info"].tolist()):
        for hv in range(HV):
            for n in OUTPUTS:
                if n == "GC":
                    got, want = bufs[n][c, hv], full[n][c, hv]
                else:
                    got = bufs[n].view(-1, HV, bufs[n].shape[-1])[row0:row0 + L, hv]
                    want = full[n].view(-1, HV, full[n].shape[-1])[row0:row0 + L, hv]
                if flags[c, hv]:
                    assert torch.equal(got, want), (n, c, hv)
                else:
                    assert bool((got == -7.0).all()), (n, c, hv)
