"""GPU test helper: run the Triton flash kernels on one entry of their tuning tables instead of autotuning."""
from delta_attn.ops.flash import launch as flash_launch


def pin_flash_tuning(monkeypatch, entry: int) -> None:
    """The Triton flash launches run entry (``entry`` mod the table's length) of each tuning table untuned, through
    the launcher's ``config=`` (the sweeps' path): tests rotate over every entry autotuning may pick, at one
    compilation per kernel where autotuning compiles them all (24 s a property test against 8 s on the H200)."""
    tables = {"fwd": flash_launch._FWD_CONFIGS, "dkdv": flash_launch._DKDV_CONFIGS, "dq": flash_launch._DQ_CONFIGS}
    launch = flash_launch._launch

    def pinned(kind, d, grid_m, rows, grid_b, args, kwargs, config=None):
        table = tables[kind][flash_launch._dclass(d)]
        return launch(kind, d, grid_m, rows, grid_b, args, kwargs, config or table[entry % len(table)])

    monkeypatch.setattr(flash_launch, "_launch", pinned)
