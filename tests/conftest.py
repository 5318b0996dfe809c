"""Shared test set-up: seeded RNG, the `gpu` marker, the Triton interpreter on CPU-only machines, and a
one-line count of the skips (and expected failures) by reason at the end of the run; the long CPU tests of
tests/slow_cpu.txt run only with --slow."""
import collections
import os

import torch

# The Triton interpreter must be switched on before any kernel module is imported: on a machine
# with no GPU, `backend="triton"` then runs the same kernels on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# one intra-op thread per pytest-xdist worker: the workers already fill the cores, and a torch op on small tensors
# run by several threads per worker spends its time with the threads waiting for each other
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="run the tests marked slow (long CPU tests, e.g. every Gluon kernel check on the emulator)")
    parser.addoption("--prop-seeds", default=None, metavar="START:STOP",
                     help="property suites (test_properties*.py): run only the seeds in [START, STOP)")


def _prop_seed_filter(config, items):
    spec = config.getoption("--prop-seeds")
    if not spec:
        return
    lo, hi = (int(x) for x in spec.split(":"))
    keep, drop = [], []
    for item in items:
        seed = getattr(getattr(item, "callspec", None), "params", {}).get("seed")
        out = item.path.name.startswith("test_properties") and seed is not None and not lo <= seed < hi
        (drop if out else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _slow_cpu_ids():
    """The node ids listed in tests/slow_cpu.txt (its header says how they were measured), run with --slow."""
    with open(os.path.join(os.path.dirname(__file__), "slow_cpu.txt")) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    _prop_seed_filter(config, items)
    slow_cpu = _slow_cpu_ids()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: none is visible (run `pytest -m gpu` on a GPU machine)")
    skip_slow = pytest.mark.skip(reason="long CPU test: run with --slow")
    for item in items:
        if item.nodeid in slow_cpu:
            item.add_marker(pytest.mark.slow)
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(skip_slow)
        if "tests/gpu/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    """Every test dispatches from scratch: tests monkeypatch what the backends' checks read (CUDA, packages,
    compute capability, the registry), which the dispatcher's cache of choices does not watch."""
    from delta_attn import backends
    backends.clear_dispatch_cache()
    yield
    backends.clear_dispatch_cache()


@pytest.fixture
def poisoned():
    """Kernel outputs start as NaN inside the test."""
    from delta_attn.testing import poison_outputs
    with poison_outputs():
        yield


def _reason(report) -> str:
    """A skipped / xfailed report's reason, without pytest's "Skipped: " prefix."""
    if hasattr(report, "wasxfail"):
        return report.wasxfail or "expected failure"
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3 else str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def pytest_terminal_summary(terminalreporter):
    """One line per kind: "N skipped: 12 × needs a CUDA GPU ...; 2 × ...", most common reason first."""
    for kind in ("skipped", "xfailed"):
        reports = terminalreporter.stats.get(kind, [])
        if reports:
            counts = collections.Counter(_reason(r) for r in reports)
            terminalreporter.write_line(f"{len(reports)} {kind}: " +
                                        "; ".join(f"{n} × {why}" for why, n in counts.most_common()))
