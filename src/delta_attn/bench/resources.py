"""The runner's per-row resource report: :class:`RowResources` watches a row's untimed first call
(:mod:`.launch_capture`: the Triton launches, and in mode ``full`` the PyTorch profiler), adds each
kernel's occupancy (:mod:`.occupancy`) and the row's roofline point (:mod:`.roofline`). report.md renders
them (``report.resources_section``, ``plots.roofline_plot``); docs/BENCH.md says what is collected when.
"""
from __future__ import annotations

from typing import Dict, Optional

from .launch_capture import FirstCall
from .occupancy import device_limits
from .roofline import row_roofline
from .rows import BenchRow

MODES = ("auto", "off", "triton", "full")
NOT_COLLECTED = ("not collected (on by default in the kernels suite; `--resources` for every suite, with the "
                 "profiler's kernel names and times)")


class RowResources:
    """The runner's side: ``first_call(task, direction)`` wraps the row's untimed first call;
    ``annotate(row)`` sets ``kernels``, ``kernels_note``, ``resources`` and ``roofline`` of every
    emitted row (JSON-serialisable values)."""

    def __init__(self, settings, ceilings: Dict, device, api=None):
        self.mode = getattr(settings, "resources", "auto") or "auto"
        if self.mode not in MODES:
            raise ValueError(f"resources must be one of {MODES}, got {self.mode!r}")
        self.ceilings = ceilings
        self.device = device
        self.api = api
        self._last: Optional[FirstCall] = None
        self._limits: Optional[Dict] = None

    def mode_for(self, task) -> str:
        if self.mode == "auto":
            return "triton" if getattr(task, "suite", None) == "kernels" else "off"
        return self.mode

    def limits(self) -> Dict:
        if self._limits is None:
            self._limits = device_limits(self.device if getattr(self.device, "type", None) == "cuda" else None)
        return self._limits

    def first_call(self, task, direction: str) -> FirstCall:
        fc = FirstCall(self.mode_for(task), self.device, task, direction, api=self.api)
        self._last = fc
        return fc

    def _matches(self, fc: Optional[FirstCall], row: BenchRow) -> bool:
        if fc is None or fc.task is None:
            return False
        t = fc.task
        return (row.impl == t.impl.name and row.direction == fc.direction
                and row.op == t.case.get("op") and row.suite == t.suite)

    def annotate(self, row: BenchRow) -> BenchRow:
        try:
            fc, self._last = self._last, None
            kernels, note, meta = None, "", None
            if row.status != "ok":
                note = f"the row did not run ({row.status})"
            elif self._matches(fc, row):
                if fc.mode == "off":
                    note = NOT_COLLECTED
                else:
                    kernels, note, meta = fc.result(row.direction, self.limits)
            elif self.mode == "off":
                note = NOT_COLLECTED
            else:
                note = NOT_COLLECTED if self.mode == "auto" and row.suite != "kernels" else "no capture"
            row.kernels, row.kernels_note, row.resources = kernels, note, meta
            row.roofline = row_roofline(row.to_json(), self.ceilings)
        except Exception as e:  # noqa: BLE001 - the report must never cost a row
            row.kernels_note = f"resource report failed: {type(e).__name__}: {e}"
        return row
