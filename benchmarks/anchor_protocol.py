#!/usr/bin/env python
"""Which forward+backward protocol reproduces the peers' figures of ANCHORS.md?

ANCHORS.md gives `triton.testing.do_bench` medians without saying how gradients were handled.
``do_bench(fn)`` with its default ``grad_to_none=None`` leaves the leaves' ``.grad`` in place, so from
the second call on every backward *adds* into the existing gradients (one extra read-read-write pass
per leaf, like gradient accumulation); ``grad_to_none=leaves`` resets them first, so the backward
only writes them. This script times FLA's ``chunk_hgrn`` and ``chunk_kda`` (and cuDNN SDPA, compute
bound, as a control) forward+backward both ways, side by side with the anchors.

``--decode``: FLA's ``fused_recurrent_kda`` decode step (B = 64, H = 16, K = V = 128, one token, fp32
state; anchor 56 us) in the ways a caller may run it: inference inputs under ``torch.no_grad`` (the
bench's protocol), inputs requiring grad with autograd on, a float32 g, and ``output_final_state``
off; each timed by ``do_bench`` (L2 flushed) and by CUDA graph replay (no CPU launch overhead).

Usage: PYTHONPATH=src python benchmarks/anchor_protocol.py [--decode] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

DT = torch.bfloat16


def leaves(*shapes, scale=None):
    out = []
    for i, s in enumerate(shapes):
        x = torch.randn(s, device="cuda", dtype=torch.float32)
        if scale and scale[i] is not None:
            x = scale[i](x)
        out.append(x.to(DT).requires_grad_())
    return out


def cases():
    """(name, anchor ms, fn, leaves) at the anchors' shapes."""
    from fla.ops.hgrn import chunk_hgrn
    from fla.ops.kda import chunk_kda
    for b, t, anchor in ((8, 4096, 1.46), (1, 32768, 2.48), (64, 1024, 2.86)):
        x, g = leaves((b, t, 2048), (b, t, 2048), scale=[None, lambda z: -torch.rand_like(z) * 0.1])
        yield f"FLA chunk_hgrn B={b} T={t}", anchor, (lambda x=x, g=g: chunk_hgrn(x, g)[0]), [x, g]
    for s, anchor_tflops in ((4096, 452), (16384, 538)):
        b = 32768 // s
        q, k, v = leaves((b, 16, s, 128), (b, 16, s, 128), (b, 16, s, 128))

        def attn(q=q, k=k, v=v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        flops = 3.5 * 4 * b * 16 * s * s * 128 / 2
        yield f"cuDNN SDPA causal S={s}", flops / (anchor_tflops * 1e12) * 1e3, attn, [q, k, v]
    for b, t, anchor in ((8, 4096, 10.1), (1, 32768, 13.0)):
        q, k, v, g, beta = leaves((b, t, 16, 128), (b, t, 16, 128), (b, t, 16, 128), (b, t, 16, 128), (b, t, 16),
                                  scale=[None, None, None, lambda z: -torch.rand_like(z) * 0.1,
                                         lambda z: torch.rand_like(z)])
        yield (f"FLA chunk_kda B={b} T={t}", anchor,
               (lambda q=q, k=k, v=v, g=g, beta=beta: chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]),
               [q, k, v, g, beta])


def decode_rows():
    from fla.ops.kda import fused_recurrent_kda
    b, h, d = 64, 16, 128
    rows = []
    print("| decode variant | do_bench us | ratio to 56 us | graph replay us |")
    print("| --- | --- | --- | --- |")
    for name, grad, g32, final in (("no_grad, bf16 g, final state", False, False, True),
                                   ("autograd on (leaves require grad), bf16 g, final state", True, False, True),
                                   ("no_grad, fp32 g, final state", False, True, True),
                                   ("no_grad, bf16 g, no final state", False, False, False)):
        q, k, v = (torch.randn(b, 1, h, d, device="cuda", dtype=DT) for _ in range(3))
        g = (-torch.rand(b, 1, h, d, device="cuda") * 0.1).to(torch.float32 if g32 else DT)
        beta = torch.rand(b, 1, h, device="cuda", dtype=DT)
        state = torch.randn(b, h, d, d, device="cuda", dtype=torch.float32)
        for x in (q, k, v, g, beta):
            x.requires_grad_(grad)

        def step():
            with torch.set_grad_enabled(grad):
                return fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=final,
                                           use_qk_l2norm_in_kernel=True)[0]
        step()
        us = do_bench(step, warmup=50, rep=300, return_mode="median") * 1e3
        graph_us = None
        if not grad:
            s_ = torch.cuda.Stream()
            s_.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s_):
                step()
            torch.cuda.current_stream().wait_stream(s_)
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                step()
            graph_us = do_bench(cg.replay, warmup=50, rep=300, return_mode="median") * 1e3
        rows.append({"variant": name, "do_bench_us": us, "graph_us": graph_us})
        print(f"| {name} | {us:.1f} | {us / 56:.2f} | {graph_us if graph_us is None else round(graph_us, 1)} |",
              flush=True)
    return rows


def other_rows():
    """Two more guesses at the anchors that no protocol above reproduces: the decode step as a packed
    varlen batch (1, 64 tokens, cu_seqlens), and cuDNN causal attention at S = 128K with q, k, v made
    as (B, S, H, D) and transposed (the layout models produce) instead of contiguous (B, H, S, D)."""
    from fla.ops.kda import fused_recurrent_kda
    rows = []
    b, h, d = 64, 16, 128
    q, k, v = (torch.randn(1, b, h, d, device="cuda", dtype=DT) for _ in range(3))
    g = (-torch.rand(1, b, h, d, device="cuda") * 0.1).to(DT)
    beta = torch.rand(1, b, h, device="cuda", dtype=DT)
    state = torch.randn(b, h, d, d, device="cuda", dtype=torch.float32)
    cu = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    with torch.no_grad():
        step = lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,  # noqa: E731
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]
        step()
        us = do_bench(step, warmup=50, rep=300, return_mode="median") * 1e3
    rows.append({"case": "fused_recurrent_kda decode as varlen (1, 64) with cu_seqlens", "us": us, "anchor_us": 56})
    print(f"| {rows[-1]['case']} | {us:.1f} us | anchor 56 us | {us / 56:.2f} |", flush=True)
    s = 131072
    for layout in ("BHSD contiguous", "BSHD transposed"):
        if layout.startswith("BHSD"):
            qa, ka, va = (torch.randn(1, 16, s, 128, device="cuda", dtype=DT) for _ in range(3))
        else:
            qa, ka, va = (torch.randn(1, s, 16, 128, device="cuda", dtype=DT).transpose(1, 2) for _ in range(3))

        def attn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                return F.scaled_dot_product_attention(qa, ka, va, is_causal=True)
        attn()
        ms = do_bench(attn, warmup=5, rep=300, return_mode="median")
        rows.append({"case": f"cuDNN SDPA causal fwd S=128K {layout}", "ms": ms, "anchor_ms": 141})
        print(f"| {rows[-1]['case']} | {ms:.1f} ms | anchor 141 ms | {ms / 141:.2f} |", flush=True)
        del qa, ka, va
    return rows


def save(rows, out, name):
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "w") as fh:
            json.dump(rows, fh, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--decode", action="store_true", help="only the fused_recurrent_kda decode variants")
    ap.add_argument("--other", action="store_true", help="only the varlen decode and the 128K layout checks")
    a = ap.parse_args()
    for flag, fn, name in ((a.other, other_rows, "anchor_other.json"), (a.decode, decode_rows, "anchor_decode.json")):
        if flag:
            save(fn(), a.out, name)
            return
    rows = []
    print("| case | anchor ms | do_bench default (grads accumulate) ms | ratio | grad_to_none ms | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, anchor, fn, lv in cases():
        out = fn()
        dout = torch.randn_like(out)
        step = lambda: fn().backward(dout)   # noqa: E731
        step()
        acc = do_bench(step, warmup=100, rep=500, return_mode="median")
        fresh = do_bench(step, warmup=100, rep=500, grad_to_none=lv, return_mode="median")
        rows.append({"case": name, "anchor_ms": anchor, "accumulate_ms": acc, "grad_to_none_ms": fresh})
        print(f"| {name} | {anchor:.3f} | {acc:.3f} | {acc / anchor:.3f} | {fresh:.3f} | {fresh / anchor:.3f} |",
              flush=True)
        del out, dout, lv
        torch.cuda.empty_cache()
    save(rows, a.out, "anchor_protocol.json")


if __name__ == "__main__":
    main()
