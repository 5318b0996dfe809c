"""A plan per batch: everything context parallelism derives from the batch's layout on the host, built once.

``dd.prepare(seqlen=..., cu_seqlens=..., group=..., layout=...)`` reads ``cu_seqlens`` on the host once,
checks it, and keeps what every context-parallel call of that batch needs: the global offsets as host
integers, their device copy, this rank's pieces of the packed sequences (linear operators: local
cu_seqlens, sequence of each piece, which ranks continue a sequence, who owns which final state), and,
built on first use per set of mask options, attention's per-rank calls with their device cu_seqlens. A call
given ``plan=`` makes no host synchronisation: no read of a device value, and host-to-device uploads
only from pinned memory without blocking (:func:`upload`). A call without a plan builds one (reading
``cu_seqlens`` on the host), so results are the same either way.
"""
from __future__ import annotations

import bisect
import contextlib
import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import _checks as C
from ._comm import group_rank_world
from .sharding import check_layout, local_length


def value_checks(plan) -> "contextlib.AbstractContextManager":
    """The context of a call's input validation: a call given a plan reads nothing on the host, so the value
    checks that would (g <= 0, as under CUDA-graph capture) are skipped and the caller keeps g <= 0; a call
    without one checks everything."""
    return C.values_checked() if plan is not None else contextlib.nullcontext()


def upload(values, device: torch.device, dtype=torch.int32) -> torch.Tensor:
    """Host integers (a sequence, or a CPU tensor) as a tensor on ``device`` without a host synchronisation: on
    CUDA through pinned memory and a non-blocking copy (the caching host allocator keeps the pinned block until
    the copy ran)."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _host_offsets(name: str, cu) -> List[int]:
    """cu_seqlens as host ints: a list / tuple, or a tensor read once (the plan's one host read)."""
    if isinstance(cu, torch.Tensor):
        C.tensor(name, cu, 1, C.INDEX_DTYPES, "(N + 1,) offsets")
        values = cu.tolist()
    elif isinstance(cu, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in cu):
        values = list(cu)
    else:
        raise TypeError(f"{name} must be an int32 / int64 tensor or a list of ints, got {type(cu).__name__}")
    if len(values) < 2:
        raise ValueError(f"{name} must have at least 2 entries (batch + 1), got {len(values)}")
    return values


# ------------------------------------------------------------------------------------------------
# linear operators: this rank's pieces of the packed sequences and the carry chain of every rank
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinearPlan:
    """The state-passing tables of one rank (``kda``, ``gated_diag_attn``; contiguous layout).

    Per rank r of the group: ``cont[r]`` its first token continues a sequence from rank r - 1 (it needs a
    carry), ``hands_on[r]`` its last token's sequence continues on rank r + 1 (= cont[r + 1]), ``passes[r]``
    both, with one sequence across the whole shard (the carry into r + 1 depends on the carry into r).
    This rank's pieces: varlen, the packed row cut by the global cu_seqlens (``cu_local``, ``seq`` the global
    sequence of each piece, ``owned`` the pieces whose sequence ends here, ``final_index`` where each
    sequence's final state lies in the gathered owned states); dense, every batch row is one piece. The Triton
    KDA's chunk tables of the local call come from :meth:`kda_chunks`."""
    varlen: bool
    rank: int
    world: int
    t_local: int
    cont: Tuple[bool, ...]
    hands_on: Tuple[bool, ...]
    passes: Tuple[bool, ...]
    first_len: int                      # rows of this rank's first piece
    last_start: int                     # first row of its last piece
    n_seq: Optional[int] = None         # varlen: sequences of the batch
    n_pieces: Optional[int] = None      # varlen: pieces on this rank
    n_owned: int = 0
    max_owned: int = 0
    cu_local: Optional[torch.Tensor] = None     # (n_pieces + 1,) int32
    seq: Optional[torch.Tensor] = None          # (n_pieces,) int64
    owned: Optional[torch.Tensor] = None        # (n_owned,) int64
    final_index: Optional[torch.Tensor] = None  # (n_seq,) int64 into cat(gathered owned, initial states)
    device: Optional[torch.device] = None
    local_offsets: Optional[Tuple[int, ...]] = None     # varlen: cu_local as host ints
    kda_tables: Dict[Tuple[int, int], object] = field(default_factory=dict, compare=False, repr=False)

    def kda_chunks(self, batch: int, bt: int):
        """The chunk tables of this rank's local KDA call for the Triton pipelines' chunk length ``bt``
        (``ops/kda/launch.py: chunk_tables``): from the plan's host integers, uploaded without blocking
        (:func:`upload`), once per (batch, bt). A packed batch's are built by :func:`prepare`."""
        key = (batch, bt)
        got = self.kda_tables.get(key)
        if got is None:
            from ..ops.kda.launch import chunk_tables
            got = self.kda_tables[key] = chunk_tables(batch, self.t_local, self.local_offsets, self.device, bt,
                                                      upload=lambda t: upload(t, self.device))
        return got

    @property
    def any_carry(self) -> bool:
        """Some rank continues a sequence (else no rank exchanges anything)."""
        return any(self.cont)

    def carry_chain(self, rank: int) -> range:
        """Ranks whose summaries make the carry into ``rank`` (cont[rank]): from the last one that does not
        pass a carry through (its summary starts the chain) to rank - 1."""
        s = rank - 1
        while self.passes[s]:
            s -= 1
        return range(s, rank)

    def grad_chain(self, rank: int) -> range:
        """Ranks whose carry gradients make the gradient of the carry into ``rank + 1`` (hands_on[rank]): from
        rank + 1 to the first one that does not pass it back further."""
        e = rank + 1
        while self.passes[e]:
            e += 1
        return range(rank + 1, e + 1)


def _dense_linear(rank: int, world: int, t_local: int, device: Optional[torch.device] = None) -> LinearPlan:
    cont = tuple(r > 0 for r in range(world))
    hands = tuple(r < world - 1 for r in range(world))
    return LinearPlan(False, rank, world, t_local, cont, hands, tuple(c and h for c, h in zip(cont, hands)),
                      first_len=t_local, last_start=0, device=device)


def _varlen_linear(cu: List[int], rank: int, world: int, t_local: int, device) -> LinearPlan:
    # per rank: the sequence holding the rank's first token (cont), and whether it reaches past the shard
    cont, passes = [], []
    n = len(cu) - 1
    for r in range(world):
        start = r * t_local
        s = bisect.bisect_right(cu, start) - 1          # last sequence starting at or before the start
        cont.append(0 <= s < n and cu[s] < start < cu[s + 1])
        passes.append(cont[-1] and cu[s + 1] > start + t_local)
    hands = tuple(cont[r + 1] if r + 1 < world else False for r in range(world))
    # this rank's pieces, the owners of every sequence's final state
    start, end = rank * t_local, (rank + 1) * t_local
    local_cu, seq, owned, index, counts = [0], [], [], [], [0] * world
    for i in range(n):
        a, b = cu[i], cu[i + 1]
        if a == b:
            index.append(None)
            continue
        r_end = (b - 1) // t_local                     # the rank holding the sequence's last token
        index.append((r_end, counts[r_end]))
        counts[r_end] += 1
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            if r_end == rank:
                owned.append(len(seq))
            seq.append(i)
            local_cu.append(hi - start)
    max_owned = max(counts)
    # row of each sequence's final state in cat(gathered owned states (W x max_owned), initial states)
    final_index = [world * max_owned + i if rs is None else rs[0] * max_owned + rs[1] for i, rs in enumerate(index)]
    lp = LinearPlan(True, rank, world, t_local, tuple(cont), hands, tuple(passes),
                    first_len=local_cu[1], last_start=local_cu[-2], n_seq=n, n_pieces=len(seq),
                    n_owned=len(owned), max_owned=max_owned, cu_local=upload(local_cu, device),
                    seq=upload(seq, device, torch.int64), owned=upload(owned, device, torch.int64),
                    final_index=upload(final_index, device, torch.int64), device=device,
                    local_offsets=tuple(local_cu))
    if importlib.util.find_spec("triton") is not None:      # the Triton KDA's tables now, not in a call
        from ..ops.kda.launch import CHUNK_LENGTHS
        for bt in CHUNK_LENGTHS:
            lp.kda_chunks(1, bt)
    return lp


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------

class Plan:
    """What :func:`prepare` built for one batch on one rank of ``group``; pass it as ``plan=`` to
    ``dd.kda``, ``dd.gated_diag_attn``, ``dd.flash_attn_func``, ``dd.flash_attn_varlen_func``.

    Attributes: ``group``, ``rank``, ``world``, ``layout``, ``device``; ``seqlen`` / ``seqlen_k`` (global
    query / key tokens: the dense sequence length or the packed total), ``t_local`` / ``tk_local`` (per
    rank); ``cu_seqlens`` / ``cu_seqlens_k`` (host tuples, None for a dense batch) and their device copies
    ``cu_seqlens_device`` / ``cu_seqlens_k_device``."""

    def __init__(self, group, rank: int, world: int, layout: str, device: torch.device, seqlen: int, seqlen_k: int,
                 cu: Optional[List[int]], cu_k: Optional[List[int]]):
        self.group, self.rank, self.world, self.layout, self.device = group, rank, world, layout, device
        self.seqlen, self.seqlen_k = seqlen, seqlen_k
        self.t_local, self.tk_local = seqlen // world, seqlen_k // world
        self.cu_seqlens = None if cu is None else tuple(cu)
        self.cu_seqlens_k = None if cu_k is None else tuple(cu_k)
        self.cu_seqlens_device = None if cu is None else upload(cu, device)
        self.cu_seqlens_k_device = (None if cu_k is None else self.cu_seqlens_device if cu_k == cu
                                    else upload(cu_k, device))
        self.max_seqlen = None if cu is None else max(b - a for a, b in zip(cu, cu[1:]))
        self.max_seqlen_k = None if cu_k is None else max(b - a for a, b in zip(cu_k, cu_k[1:]))
        self._cache: Dict[tuple, object] = {}

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def num_seqs(self) -> Optional[int]:
        return None if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    def __repr__(self):
        what = f"{self.num_seqs} packed sequences" if self.varlen else "dense"
        return (f"Plan({what}, seqlen={self.seqlen}, seqlen_k={self.seqlen_k}, layout={self.layout!r}, "
                f"rank {self.rank} of {self.world}, device={self.device})")

    def cached(self, key: tuple, build: Callable[[], object]):
        """``build()`` once per ``key`` (per set of call options): host work and non-blocking uploads only."""
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = build()
        return got

    def linear(self) -> LinearPlan:
        if self.layout != "contiguous":
            raise ValueError(f"the linear operators take the contiguous layout only: this plan was built with "
                             f"layout={self.layout!r}")
        if self.varlen and self.cu_seqlens_k != self.cu_seqlens:
            raise ValueError("the linear operators take one cu_seqlens: this plan was built with a different "
                             "cu_seqlens_k")
        if self.varlen:
            return self.cached(("linear",), lambda: _varlen_linear(list(self.cu_seqlens), self.rank, self.world,
                                                                   self.t_local, self.device))
        return self.cached(("linear",), lambda: _dense_linear(self.rank, self.world, self.t_local, self.device))

    # ---- checks of a call against the plan (host only) ----

    def check(self, op: str, group, *, device: torch.device, varlen: bool, t_local: int,
              tk_local: Optional[int] = None, layout: Optional[str] = None,
              cu_seqlens: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None) -> None:
        """ValueError naming what differs between this plan and a call of ``op``."""
        def bad(what):
            raise ValueError(f"{op}: plan= was built for {what}; build one per batch with dd.prepare(...) "
                             f"for this call ({self!r})")
        if group is not self.group:
            bad("another process group (pass the group the plan was prepared with)")
        rank, world = group_rank_world(group)
        if (rank, world) != (self.rank, self.world):
            bad(f"rank {self.rank} of {self.world}, but this is rank {rank} of {world}")
        if layout is not None and layout != self.layout:
            bad(f"layout={self.layout!r}, but the call asks for layout={layout!r}")
        if device != self.device:
            bad(f"device {self.device}, but the inputs are on {device}")
        if varlen != self.varlen:
            bad("a packed batch (cu_seqlens)" if self.varlen else "a dense batch (no cu_seqlens)")
        if t_local != self.t_local:
            bad(f"{self.t_local} local tokens per rank (global {self.seqlen}), but this rank holds {t_local}")
        if tk_local is not None and tk_local != self.tk_local:
            bad(f"{self.tk_local} local keys per rank (global {self.seqlen_k}), but this rank holds {tk_local}")
        for name, cu, want in (("cu_seqlens", cu_seqlens, self.cu_seqlens), ("cu_seqlens_k", cu_seqlens_k,
                                                                             self.cu_seqlens_k)):
            if cu is None:
                continue
            C.cu_seqlens_meta(name, cu, device)
            if want is None or cu.numel() != len(want):
                bad(f"{'no' if want is None else len(want)} {name} entries, but the call passes {cu.numel()}")


def prepare(*, seqlen: Optional[int] = None, cu_seqlens=None, group=None, layout: str = "contiguous",
            seqlen_k: Optional[int] = None, cu_seqlens_k=None, device=None) -> Plan:
    """The plan of one batch for this rank of ``group`` (default: the world), to pass as ``plan=`` to every
    context-parallel call of the batch (all layers): those calls then make no host synchronisation.

    - dense batch: ``seqlen`` = the global sequence length T (= W x the local length); attention with
      Sk != Sq: ``seqlen_k`` too;
    - packed batch: ``cu_seqlens`` (global offsets: a tensor, read on the host here once, or a list of ints),
      ``seqlen`` defaults to its last entry; attention with other key boundaries: ``cu_seqlens_k``.

    ``layout``: "contiguous" (linear operators and attention) or "zigzag" (attention). ``device``: where the
    plan's index tensors live (default: that of a ``cu_seqlens`` tensor, else the current CUDA device when
    there is one, else the CPU); the calls' inputs must be there. Checks here what the calls would check:
    offsets start at 0, do not decrease, end at ``seqlen``, and the lengths divide into equal shards."""
    rank, world = group_rank_world(group)
    check_layout(layout)
    if device is None:
        if isinstance(cu_seqlens, torch.Tensor):
            device = cu_seqlens.device
        else:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cu = cu_k = None
    if cu_seqlens is not None:
        cu = _host_offsets("cu_seqlens", cu_seqlens)
        cu_k = cu if cu_seqlens_k is None else _host_offsets("cu_seqlens_k", cu_seqlens_k)
        if len(cu_k) != len(cu):
            raise ValueError(f"cu_seqlens_k must describe as many sequences as cu_seqlens ({len(cu) - 1}), "
                             f"got {len(cu_k) - 1}")
        seqlen = cu[-1] if seqlen is None else seqlen
        seqlen_k = (cu_k[-1] if cu_seqlens_k is not None else seqlen) if seqlen_k is None else seqlen_k
    elif cu_seqlens_k is not None:
        raise ValueError("cu_seqlens_k needs cu_seqlens (the queries' offsets)")
    if seqlen is None:
        raise ValueError("prepare needs seqlen (the global sequence length of a dense batch) or cu_seqlens")
    seqlen_k = seqlen if seqlen_k is None else seqlen_k
    for name, n in (("seqlen", seqlen), ("seqlen_k", seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        C.positive_dim(name, n)
    if cu is not None:
        C.cu_seqlens_values("cu_seqlens", cu, seqlen)
        C.cu_seqlens_values("cu_seqlens_k", cu_k, seqlen_k)
    for name, n in (("seqlen", seqlen), ("seqlen_k", seqlen_k)):
        local_length(n, world, layout, name)
    plan = Plan(group, rank, world, layout, device, seqlen, seqlen_k, cu, cu_k)
    if layout == "contiguous" and cu_k == cu:
        plan.linear()                       # the linear operators' tables now, not at the first call
    return plan


def resolve(plan: Optional[Plan], op: str, group, build: Callable[[], Plan], **call) -> Plan:
    """The call's plan: ``plan`` checked against the call (``call``: the keywords of :meth:`Plan.check`), or,
    for None, ``build()`` (the call's own arguments, read on the host)."""
    if plan is None:
        return build()
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a delta_attn.distributed.Plan (from dd.prepare), got {type(plan).__name__}")
    plan.check(op, group, **call)
    return plan
