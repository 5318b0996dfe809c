"""What the GPU checks of KDA's Gluon training kernels share (tests/gpu/test_kda_intra_fused_gpu.py,
test_kda_bwd_fused_gpu.py, test_kda_scan_gpu.py; on CPU through tests/ops/test_kda_train_gluon_emulated.py): the
planted decays, the rows of unflagged (chunk, value head) pairs, the per-head relative error, a device sync; and the
spy on the g <= 0 check's kernel reports (with tests/gpu/test_kda_fused_gpu.py)."""
from __future__ import annotations

import torch


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def kernel_name(kernel) -> str:
    return getattr(kernel, "fn", kernel).__name__


def decays(shape, kind: str, gen, cu=None, planted=slice(0, 16)) -> torch.Tensor:
    """fp32 log decays (B, T, HV, K): "long" logsigmoid(N(4, 1)), "strong" logsigmoid(N(0, 1)); "one" / "pair": long
    ones with -1e4 planted in every value head's channels ``planted`` at row 45 / rows 40 and 41 of every chunk long
    enough; "nan": NaN in channels 32-63 (a whole K slice) at row 5 (chunks of 64 rows from each sequence's start:
    ``cu``, or each batch row's)."""
    B, T, HV, _ = shape
    mean = 0.0 if kind == "strong" else 4.0
    g = torch.nn.functional.logsigmoid(torch.randn(shape, generator=gen) + mean)
    rows = {"one": (45,), "pair": (40, 41), "nan": (5,)}.get(kind, ())
    bounds = list(zip(cu[:-1], cu[1:])) if cu is not None else [(b * T, (b + 1) * T) for b in range(B)]
    flat = g.view(B * T, HV, -1)
    for bos, eos in bounds:
        for c0 in range(bos, eos, 64):
            for r in (rows if rows and c0 + max(rows) < eos else ()):
                if kind == "nan":
                    flat[c0 + r, :, 32:64] = float("nan")
                else:
                    flat[c0 + r, :, planted] = -1e4
    return g


def pair_rows(chunk_t: torch.Tensor, flags: torch.Tensor, R: int) -> torch.Tensor:
    """(R, HV) bool: the rows of each (chunk, value head) pair whose flag is 0."""
    HV = flags.shape[1]
    keep = torch.zeros(R, HV, dtype=torch.bool)
    for (_, row0, L), f in zip(chunk_t.tolist(), flags.cpu()):
        keep[row0:row0 + L] = (f == 0)[None, :]
    return keep


def per_head_error(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor) -> float:
    """max over value heads of max|a - b| / max|b| on the kept rows (a, b: (R, HV, ...))."""
    a, b = a.double().cpu(), b.double().cpu()
    worst = 0.0
    for h in range(b.shape[1]):
        rows = keep[:, h]
        if not rows.any():
            continue
        x, y = a[rows, h], b[rows, h]
        assert torch.isfinite(x).all() and torch.isfinite(y).all(), f"head {h}: non-finite entries"
        scale = float(y.abs().max())
        err = float((x - y).abs().max())
        worst = max(worst, err / scale if scale > 0 else err)
    return worst


def gluon_runs(unsupported: str) -> bool:
    """Whether the training dispatch test ``launch.<unsupported>`` lets its Gluon kernel run on this machine's CUDA
    device (bf16, K = V = 128, no gate)."""
    from delta_attn.ops.kda import launch
    if not torch.cuda.is_available():
        return False
    x = torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16)
    prec = launch.precision(torch.bfloat16, False, 128, train=True)
    return getattr(launch, unsupported)(x, x, None, None, None, prec, x.device) is None


WHOLE = [
    # the whole-gradient cases, KDACase fields that vary: B, T, cu, H, HV, l2, decay kind, g and beta in float32
    # (else bf16, which the Gluon kernels read as given and widen on chip)
    (2, 300, None, 2, 2, True, "long", True),
    (2, 300, None, 2, 2, False, "strong", True),
    (1, 333, (0, 100, 237, 333), 1, 2, True, "long", True),
    (1, 400, (0, 150, 400), 2, 4, True, "pair", True),
    (2, 200, None, 2, 4, False, "one", True),
    (2, 200, None, 2, 2, True, "long", False),
]


def whole_gradients_pass(dev, B, T, cu, H, HV, l2, decay, fp32_gb, planted=slice(0, 16)) -> None:
    """``da.kda(..., backend="triton")`` forward and backward in the Gluon domain (bf16, K = V = 128, g and beta in
    float32 or bf16, initial and final states) against the float64 reference with the error rule."""
    import properties as P
    c = P.KDACase(seed=7, B=B, T=T, cu=cu, H=H, HV=HV, K=128, V=128, dtype="bf16", gate=None, l2=l2, h0=True,
                  final=True, decay=None, scale=None, fp32_gb=fp32_gb, grad=True)
    xs, kw = P.kda_inputs(c, dev)
    gb = torch.float32 if fp32_gb else torch.bfloat16
    xs[3] = decays((B, T, HV, 128), decay, torch.Generator().manual_seed(11), cu, planted=planted).to(dev, gb)
    assert xs[3].dtype == xs[4].dtype == gb
    bad, _ = P.kda_compare(xs, kw, True, c.seed, use_qk_l2norm=l2, output_final_state=True)
    assert not bad, "; ".join(bad)


def spy_check_order(monkeypatch):
    """The order in which a call enqueues its work: ("reduce", numel, stream, requires_grad) for every
    ``Tensor.amax`` (the current CUDA stream then, None on the CPU) and every reduction of ``ops/_decay_max.py``
    (the stream it is enqueued on), ("kernel", name) for every Triton / Gluon launch through ``_launch._run`` and
    ("kernel", "fused_forward") for the fused forward (launched directly). The g <= 0 check's reduction of g must
    come before the call's first kernel."""
    from delta_attn.ops import _decay_max, _launch
    from delta_attn.ops.kda import launch
    events = []
    real_run, real_fused, real_amax = _launch._run, launch.fused_forward, torch.Tensor.amax
    real_small = _decay_max.start_positive_max

    def small(x, stream):
        read = real_small(x, stream)
        if read is not None:
            events.append(("reduce", x.numel(), stream, x.requires_grad))
        return read

    def run(p):
        events.append(("kernel", kernel_name(p.kernel)))
        return real_run(p)

    def fused(*args, **kw):
        events.append(("kernel", "fused_forward"))
        return real_fused(*args, **kw)

    def amax(self, *a, **kw):
        stream = torch.cuda.current_stream(self.device) if self.is_cuda else None
        events.append(("reduce", self.numel(), stream, self.requires_grad))
        return real_amax(self, *a, **kw)

    monkeypatch.setattr(_launch, "_run", run)
    monkeypatch.setattr(launch, "fused_forward", fused)
    monkeypatch.setattr(torch.Tensor, "amax", amax)
    monkeypatch.setattr(_decay_max, "start_positive_max", small)
    return events


def reduced_before_kernels(events, g) -> bool:
    """g reduced once by the check, before the first kernel (a NaN in g adds a second pass after it)."""
    kernels = [i for i, e in enumerate(events) if e[0] == "kernel"]
    reductions = [i for i, e in enumerate(events) if e[:2] == ("reduce", g.numel())]
    return bool(kernels) and bool(reductions) and reductions[0] < kernels[0]


def reduced_beside_kernels(events, g) -> bool:
    """The check's reduction of g ran on a stream other than the caller's, so the kernels did not wait for it."""
    streams = [e[2] for e in events if e[:2] == ("reduce", g.numel())]
    return bool(streams) and streams[0] is not None and streams[0] != torch.cuda.current_stream(g.device)
