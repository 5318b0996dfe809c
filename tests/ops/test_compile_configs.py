"""``_launch.compile_configs``: every configuration of every job is compiled (``warmup`` with the launch's own
arguments and the configuration's meta-parameters, warps and stages), concurrently, and a configuration that
fails to build is left for the autotuner to report."""
import contextlib
import threading
import time

import torch
import triton

from delta_attn.ops import _launch


class FakeKernel:
    def __init__(self, fail=()):
        self.calls, self.threads, self.fail = [], set(), fail

    def warmup(self, *args, grid, **kwargs):
        self.threads.add(threading.get_ident())
        time.sleep(0.05)                       # long enough for the pool to start every job at once
        self.calls.append((args, kwargs))
        if kwargs["BLOCK"] in self.fail:
            raise RuntimeError("does not build")
        return type("Compiled", (), {"_init_handles": lambda self: None})()


def test_every_configuration_compiles_concurrently(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_launch, "_prime_jit", lambda kernel, device: None)
    a, b = FakeKernel(), FakeKernel(fail=(32,))
    x = torch.zeros(4)
    configs = [triton.Config({"BLOCK": n}, num_warps=w, num_stages=s) for n, w, s in ((16, 4, 2), (32, 8, 3))]
    _launch.compile_configs([(a, (x, 7), {"FLAG": True}, configs), (b, (x,), {}, configs)])
    assert sorted((kw["BLOCK"], kw["num_warps"], kw["num_stages"], kw.get("FLAG")) for _, kw in a.calls) == [
        (16, 4, 2, True), (32, 8, 3, True)]
    assert all(args == (x, 7) for args, _ in a.calls)
    assert len(b.calls) == 2                   # the failing configuration was tried and did not stop the rest
    assert len(a.threads | b.threads) > 1


def test_flash_compiles_each_new_autotune_key_once_and_skips_fixed_configurations(monkeypatch):
    """flash's compile-ahead hands every configuration of a new autotune key to compile_configs, once per key,
    and nothing for a launch with a fixed configuration or an empty grid."""
    from delta_attn.ops.flash import launch as fl
    jobs = []
    monkeypatch.setattr(fl.settings, "triton_interpreter", lambda: False)
    monkeypatch.setattr(fl, "compile_configs", jobs.extend)
    monkeypatch.setattr(fl, "_COMPILED_KEYS", set())
    x = torch.zeros(4, dtype=torch.bfloat16)
    kw = dict(SQ_BUCKET=64, SK_BUCKET=64, REVERSE_M=False, PLAIN=True, TMA_OK=False, IS_VARLEN=False,
              SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, HAS_WL=False, HAS_WR=True, HEAD_DIM=128)
    new = ("fwd", 128, "BLOCK_M", 100, 2, (x,), kw, None)
    fl._compile_ahead([new, ("fwd", 128, "BLOCK_M", 100, 2, (x,), kw, (128, 128, 8, 3)),
                       ("fwd", 128, "BLOCK_M", 0, 2, (x,), kw, None)])
    assert [(k, c) for k, _, _, c in jobs] == [(fl._flash_fwd_kernel, fl._tuned("fwd", 128).configs)]
    fl._compile_ahead([new])                   # the same key again: nothing more to compile
    assert len(jobs) == 1
