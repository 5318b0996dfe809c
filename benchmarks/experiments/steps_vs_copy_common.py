import torch
from delta_attn.bench.timer import measure

dev = torch.device("cuda")


def capture(fn):
    """fn warmed up on a side stream (three calls), then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_ms(fn):
    g = capture(fn)
    g.replay(); torch.cuda.synchronize()
    return measure(g.replay, dev, rep_ms=200, max_reps=400).median_ms


def ceiling_tbps():
    big = torch.empty(2 ** 30 // 4, device=dev)
    big2 = torch.empty_like(big)
    ms = measure(lambda: big2.copy_(big), dev).median_ms
    return 2 * big.numel() * 4 / ms / 1e9
