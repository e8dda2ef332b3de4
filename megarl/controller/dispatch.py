"""Distribution declared on the worker method: `@dispatch(mode)` says how one controller call becomes per-rank calls
and how the per-rank results become one controller result.

Data path (one controller call `group.method(*args, **kwargs)`):
  1. `plan_calls(spec, args, kwargs, world_size, replica_of)` -> one (args, kwargs) per rank  [pure, this module]
  2. the `WorkerGroup` sends call r to rank r (every rank is called in every mode: SPMD collectives need all)
  3. `collect(spec, results, replica_of)` -> the controller's return value                      [pure, this module]

Modes (`Dispatch`):
  ONE_TO_ALL               same args to every rank; returns [result of rank 0, ..., result of rank W-1].
  ALL_TO_ALL               every argument is a sequence of length W; rank i gets element i of each; returns the list.
  RANK_ZERO                same args to every rank; returns rank 0's result.
  LAST_STAGE_FIRST_RESULT  same args to every rank; returns the first non-None result in rank order (roles return
                           results only on their last pipeline stage) or None.
  DP_SPLIT                 the first positional argument (a list, tuple, tensor -- dim 0 -- or `megarl.data.Batch`)
                           is cut into n_replicas contiguous chunks (sizes differ by at most one, the first ones
                           larger: `chunk_bounds`); every rank of replica k (its TP ranks and pipeline stages) gets
                           chunk k and only it, the other arguments go to every rank unchanged. Per replica the
                           first non-None result (rank order: the replica's first last-stage rank) is kept; the
                           replicas' results are concatenated in replica order (lists/tuples -> list, tensors ->
                           torch.cat on dim 0, Batch -> Batch.concat); results of other types come back as a list
                           with one entry per replica.
  DP_SPLIT_MINI_BATCHES    an update's batch (the first positional argument, a `megarl.data.Batch`) cut the way the
                           role trains on it (`megarl.data.mini_batches`): consecutive mini-batches of the role's
                           `mini_batch_samples` (asked of rank 0 through `dispatch(..., mini_batch_attr="name")`),
                           each cut into n_replicas equal contiguous shares; every rank of replica k gets its share of
                           every mini-batch, concatenated in mini-batch order, with the layout in
                           `meta[SHARE_META]` (what the role needs to re-cut the same mini-batches). Replicas as for
                           DP_SPLIT; the other arguments go to every rank unchanged; returns rank 0's result (an
                           update's metrics, identical on every rank).

Declared reads (`dispatch(..., reads=(...), optional_reads=(...))`): when the call's first positional argument is a
`megarl.data.Batch`, the controller keeps only the tensors the method reads before it cuts the batch (`select_reads`):
every key of `reads` (missing ones raise `DispatchError` naming the method and the keys), and those of
`optional_reads` the batch has (conditional keys: `routed_experts` with router replay, `rollout_log_probs` with
rollout correction, ...). `meta` travels whole (small: the share layout) and records the method in
`meta[READS_META]`, so a method that reads a tensor it did not declare fails with a KeyError naming the method and
the key (`Batch.__getitem__` / `Batch.require`) instead of silently receiving the whole batch.

Shares by reference (`plan_shared_calls`, used inside a `megarl.controller.shares.BatchShares` block): a DP call with
declared reads over a Batch sends each replica a `ShareRefs` -- per key it reads, handles of the row pieces of its
share (its rows cut at every share boundary of the step's calls: `share_rows`, `cut_ranges`) -- instead of a copy;
the worker turns it back into the same Batch (`resolve_shares`). A piece is put once however many calls read it.

Replicas for DP_SPLIT: replica of rank r = r // group_size, where group_size (the ranks of one model replica,
tp*cp for pp=1) is taken from, in order: `dispatch(..., group_size=N)`; the worker attribute (or zero-argument
method) named by `dispatch(..., group_size_attr="name")`; the worker attribute `dp_group_size`. This matches
megatron's rank order only when pp == 1 (dp varies faster than pp, see megarl.parallel.topology); for pp > 1 give
`replica_attr="name"`: a worker attribute/method returning (replica index, number of replicas) of its rank, e.g.
(groups.coord.dp, topo.dp), which is asked of every rank. DP_SPLIT_MINI_BATCHES finds its replicas the same way.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Optional, Sequence

from megarl.data.mini_batches import SHARE_META, share_layout

# `Batch.meta` key of a DP_SPLIT share: [lo, hi), the rows of the whole batch it holds (what a worker keeping its
# results records, so a later update can find its rows there: `shares_cover`)
SPLIT_ROWS_META = "dp_split_rows"

DISPATCH_ATTR = "__megarl_dispatch__"
DEFAULT_GROUP_SIZE_ATTR = "dp_group_size"


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    LAST_STAGE_FIRST_RESULT = "last_stage_first_result"
    DP_SPLIT = "dp_split"
    DP_SPLIT_MINI_BATCHES = "dp_split_mini_batches"


ONE_TO_ALL = Dispatch.ONE_TO_ALL
ALL_TO_ALL = Dispatch.ALL_TO_ALL
RANK_ZERO = Dispatch.RANK_ZERO
LAST_STAGE_FIRST_RESULT = Dispatch.LAST_STAGE_FIRST_RESULT
DP_SPLIT = Dispatch.DP_SPLIT
DP_SPLIT_MINI_BATCHES = Dispatch.DP_SPLIT_MINI_BATCHES
DP_MODES = (DP_SPLIT, DP_SPLIT_MINI_BATCHES)  # the modes that cut data per replica


class DispatchError(ValueError):
    """A controller call whose arguments do not fit the method's dispatch mode (names the method and the numbers)."""


@dataclasses.dataclass(frozen=True)
class DispatchSpec:
    """What `@dispatch` records on a worker method."""

    mode: Dispatch
    group_size: Optional[int] = None
    group_size_attr: Optional[str] = None
    replica_attr: Optional[str] = None
    timeout_s: Optional[float] = None
    mini_batch_attr: Optional[str] = None
    reads: Optional[tuple[str, ...]] = None
    optional_reads: tuple[str, ...] = ()


def dispatch(
    mode: Dispatch,
    *,
    group_size: Optional[int] = None,
    group_size_attr: Optional[str] = None,
    replica_attr: Optional[str] = None,
    timeout_s: Optional[float] = None,
    mini_batch_attr: Optional[str] = None,
    reads: Optional[Sequence[str]] = None,
    optional_reads: Sequence[str] = (),
) -> Callable[[Callable], Callable]:
    """Mark a worker method as callable from the controller with distribution `mode` (see the module docstring).

    `timeout_s` overrides the worker group's call timeout for this method. `mini_batch_attr` (DP_SPLIT_MINI_BATCHES
    only, and required there): the worker attribute (or zero-argument method) holding the role's global mini-batch
    size in samples (None = the whole batch). `reads` / `optional_reads`: the tensor keys of the Batch argument the
    method reads (always / when present; see "Declared reads" in the module docstring); `reads=None`: the whole
    batch is sent. The method itself is unchanged: on the worker it is an ordinary method; only `WorkerGroup` reads
    the mark.
    """
    if not isinstance(mode, Dispatch):
        raise TypeError(f"dispatch mode must be a megarl.controller.Dispatch, got {mode!r}")
    if mode not in DP_MODES and (group_size or group_size_attr or replica_attr):
        raise TypeError(f"group_size/group_size_attr/replica_attr only apply to "
                        f"{' and '.join(m.name for m in DP_MODES)}, not {mode.name}")
    if (mode is Dispatch.DP_SPLIT_MINI_BATCHES) != (mini_batch_attr is not None):
        raise TypeError(f"mini_batch_attr is required by DP_SPLIT_MINI_BATCHES and only applies to it ({mode.name})")
    if group_size is not None and group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if reads is None and optional_reads:
        raise TypeError("optional_reads needs reads (the keys the method always reads)")
    for keys in (reads or (), optional_reads):
        if isinstance(keys, str):
            raise TypeError(f"reads / optional_reads are sequences of key names, got the string {keys!r}")
    spec = DispatchSpec(mode, group_size, group_size_attr, replica_attr, timeout_s, mini_batch_attr,
                        None if reads is None else tuple(reads), tuple(optional_reads))

    def mark(fn: Callable) -> Callable:
        setattr(fn, DISPATCH_ATTR, spec)
        return fn

    return mark


def dispatched_methods(worker_cls: type) -> dict[str, DispatchSpec]:
    """Name -> spec of every `@dispatch`-decorated method of `worker_cls` (inherited ones included)."""
    out = {}
    for name in dir(worker_cls):
        spec = getattr(getattr(worker_cls, name, None), DISPATCH_ATTR, None)
        if isinstance(spec, DispatchSpec):
            out[name] = spec
    return out


# -- replicas --------------------------------------------------------------------------------------------------------


def replicas_from_group_size(world_size: int, group_size: int, method: str = "?") -> list[int]:
    """Replica index of each rank when replica = rank // group_size."""
    if group_size < 1 or world_size % group_size:
        raise DispatchError(
            f"{method}: DP_SPLIT group_size {group_size} does not divide the group's {world_size} ranks"
        )
    return [r // group_size for r in range(world_size)]


def replicas_from_coords(coords: Sequence[Sequence[int]], method: str = "?") -> list[int]:
    """Replica index of each rank from per-rank (replica, n_replicas); checks they agree and cover 0..n-1."""
    ns = {int(n) for _, n in coords}
    if len(ns) != 1:
        raise DispatchError(f"{method}: ranks disagree on the number of replicas: {[tuple(c) for c in coords]}")
    n = ns.pop()
    replica_of = [int(k) for k, _ in coords]
    if sorted(set(replica_of)) != list(range(n)):
        raise DispatchError(f"{method}: replica indices {replica_of} do not cover 0..{n - 1}")
    return replica_of


# -- split and concatenate -------------------------------------------------------------------------------------------


def _is_batch(x: Any) -> bool:
    return type(x).__name__ == "Batch" and hasattr(x, "slice") and hasattr(type(x), "concat")


def chunk_bounds(n: int, parts: int, k: int) -> tuple[int, int]:
    """[lo, hi) of chunk k when n items are cut into `parts` contiguous chunks whose sizes differ by at most one
    (the first n % parts chunks hold one more). The controller's DP split and the offsets it uses to put per-replica
    results back in order both come from this one function."""
    if parts < 1 or not 0 <= k < parts:
        raise ValueError(f"chunk {k} is outside 0..{parts - 1}")
    base, extra = divmod(n, parts)
    lo = k * base + min(k, extra)
    return lo, lo + base + (1 if k < extra else 0)


def split_contiguous(x: Any, n: int, method: str = "?") -> list[Any]:
    """Cut `x` (list, tuple, torch.Tensor on dim 0, or Batch) into `n` contiguous chunks, sizes differing by at most
    one (`chunk_bounds`); concatenating the chunks in order gives `x` back."""
    import torch

    if isinstance(x, (list, tuple)) or isinstance(x, torch.Tensor) or _is_batch(x):
        size = len(x)
    else:
        raise DispatchError(
            f"{method}: DP_SPLIT splits its first positional argument, which must be a list, tuple, tensor or "
            f"Batch; got {type(x).__name__}"
        )
    if size < n:
        raise DispatchError(f"{method}: DP_SPLIT cannot give each of {n} replicas at least one of {size} items; "
                            f"send at least {n} items (or use fewer data-parallel ranks)")
    bounds = [chunk_bounds(size, n, k) for k in range(n)]
    # Tensor chunks are copied: a slice is a view, and pickling a view (what Ray does) ships its whole storage,
    # i.e. the full batch to every rank again.
    if _is_batch(x):
        return [type(x)({k: v[lo:hi].clone() for k, v in x.tensors.items()}, {**x.meta, SPLIT_ROWS_META: [lo, hi]})
                for lo, hi in bounds]
    if isinstance(x, torch.Tensor):
        return [x[lo:hi].clone() for lo, hi in bounds]
    return [x[lo:hi] for lo, hi in bounds]


def split_mini_batches(x: Any, n: int, mini_batch_samples: Optional[int], method: str = "?") -> list[Any]:
    """Cut an update's `Batch` for `n` replicas (`megarl.data.mini_batches`): replica k's piece is its share of
    every mini-batch of `mini_batch_samples` (None = one mini-batch), concatenated in mini-batch order, a compact
    copy, with its `ShareLayout` in `meta[SHARE_META]`."""
    import torch

    if not _is_batch(x):
        raise DispatchError(f"{method}: DP_SPLIT_MINI_BATCHES cuts a Batch (its first positional argument); got "
                            f"{type(x).__name__}")
    try:
        layouts = [share_layout(len(x), mini_batch_samples, n, k) for k in range(n)]
    except ValueError as e:
        raise DispatchError(f"{method}: {e}") from None
    out = []
    for lay in layouts:
        part = x.index(torch.cat([torch.arange(lo, hi) for lo, hi in lay.rows]))  # indexing copies: a compact share
        part.meta[SHARE_META] = lay.to_meta()
        out.append(part)
    return out


def shares_cover(producer_replica_of: Sequence[int], consumer_replica_of: Sequence[int], rows: int,
                 mini_batch_samples: Optional[int]) -> bool:
    """Whether every rank's DP_SPLIT share of `rows` rows (replicas `producer_replica_of`) holds every row its
    DP_SPLIT_MINI_BATCHES share of the same rows (replicas `consumer_replica_of`, `mini_batch_samples`) trains on: then
    results a rank computed and kept (`RoleHost`, e.g. old log-probs) can feed its update without the controller.
    True with one replica, and when the update is one mini-batch cut as the forward was; False when the layouts
    differ or the update cannot be cut."""
    if len(producer_replica_of) != len(consumer_replica_of):
        return False
    n_p, n_c = max(producer_replica_of) + 1, max(consumer_replica_of) + 1
    if rows < n_p:
        return False
    for kp, kc in zip(producer_replica_of, consumer_replica_of):
        lo, hi = chunk_bounds(rows, n_p, kp)
        try:
            need = share_layout(rows, mini_batch_samples, n_c, kc).rows
        except ValueError:
            return False
        if any(a < lo or b > hi for a, b in need):
            return False
    return True


def shares_exchange(producer_replica_of: Sequence[int], consumer_replica_of: Sequence[int], rows: int,
                    mini_batch_samples: Optional[int]) -> bool:
    """Whether results kept by the DP_SPLIT method's ranks (replicas `producer_replica_of`) can feed the
    DP_SPLIT_MINI_BATCHES method's shares (`consumer_replica_of`, `mini_batch_samples`) of `rows` rows by the ranks
    exchanging rows among their DP peers (`RoleHost._with_kept(exchange=True)`) where `shares_cover` is False: the
    same replica of every rank in both (the same DP groups; the forward's shares then tile the batch over each
    group), and the update can be cut."""
    if list(producer_replica_of) != list(consumer_replica_of) or rows < max(producer_replica_of) + 1:
        return False
    n = max(consumer_replica_of) + 1
    try:
        for k in range(n):
            share_layout(rows, mini_batch_samples, n, k)
    except ValueError:
        return False
    return True


def concat_results(parts: list[Any]) -> Any:
    """Concatenate per-replica results in order (see the module docstring for the types)."""
    import torch

    present = [p for p in parts if p is not None]
    if not present:
        return None
    if len(present) == len(parts):
        if all(isinstance(p, (list, tuple)) for p in parts):
            return [x for p in parts for x in p]
        if all(isinstance(p, torch.Tensor) for p in parts):
            return torch.cat(parts, dim=0)
        if all(_is_batch(p) for p in parts):
            return type(parts[0]).concat(parts)
    return list(parts)


def select_reads(spec: DispatchSpec, x: Any, method: str = "?") -> Any:
    """`x` with only the tensors `spec` declares it reads (all of `reads`, the present ones of `optional_reads`), its
    meta copied and marked with `method` (`READS_META`); `x` itself when `spec.reads` is None. Raises DispatchError
    when `x` is not a Batch or lacks a key of `reads`."""
    if spec.reads is None:
        return x
    if not _is_batch(x):
        raise DispatchError(f"{method}: declares the batch keys it reads, so its first positional argument must be a "
                            f"Batch; got {type(x).__name__}")
    from megarl.data.batch import READS_META

    missing = [k for k in spec.reads if k not in x.tensors]
    if missing:
        raise DispatchError(f"{method} reads {missing} (its @dispatch reads) but the batch has only "
                            f"{sorted(x.tensors)}: compute them before this call")
    keys = list(spec.reads) + [k for k in spec.optional_reads if k in x.tensors and k not in spec.reads]
    return type(x)({k: x.tensors[k] for k in keys}, {**x.meta, READS_META: method})


# -- shares by reference --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ShareRefs:
    """One replica's share of a batch as handles to row pieces that were put into the object store once
    (`plan_shared_calls`): `pieces[key]` are the handles of that key's pieces in row order (their concatenation on dim
    0 is the key's share), `meta` the share's meta as `plan_calls` gives it. The worker turns it back into the
    `Batch` `plan_calls` would have sent (`resolve_shares`)."""

    pieces: dict[str, list[Any]]
    meta: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class InlinePiece:
    """A row piece sent with the call instead of put (`BatchShares.piece`: a small per-sequence piece, e.g. [rows]
    advantages): `value` is the piece itself; `resolve_shares` uses it as is (no object-store round trip)."""

    value: Any


def share_rows(spec: DispatchSpec, rows: int, n_replicas: int, mini_batch_samples: Optional[int],
               method: str = "?") -> list[tuple[list[tuple[int, int]], dict[str, Any]]]:
    """Per replica of a DP call over a batch of `rows` rows: ([lo, hi) ranges of the batch in its share, in order;
    the meta its share carries: `SPLIT_ROWS_META` for DP_SPLIT, `SHARE_META` for DP_SPLIT_MINI_BATCHES) -- the rows
    `split_contiguous` / `split_mini_batches` cut."""
    if spec.mode is Dispatch.DP_SPLIT:
        if rows < n_replicas:
            raise DispatchError(f"{method}: DP_SPLIT cannot give each of {n_replicas} replicas at least one of {rows} "
                                "items; send at least that many items (or use fewer data-parallel ranks)")
        bounds = [chunk_bounds(rows, n_replicas, k) for k in range(n_replicas)]
        return [([(lo, hi)], {SPLIT_ROWS_META: [lo, hi]}) for lo, hi in bounds]
    if spec.mode is Dispatch.DP_SPLIT_MINI_BATCHES:
        try:
            layouts = [share_layout(rows, mini_batch_samples, n_replicas, k) for k in range(n_replicas)]
        except ValueError as e:
            raise DispatchError(f"{method}: {e}") from None
        return [(lay.rows, {SHARE_META: lay.to_meta()}) for lay in layouts]
    raise DispatchError(f"{method}: {spec.mode.name} does not cut rows per replica")


def cut_ranges(ranges: Sequence[tuple[int, int]], cuts: Sequence[int]) -> list[tuple[int, int]]:
    """`ranges` ([lo, hi) in order) cut further at every point of `cuts` strictly inside one of them: the pieces a
    share is made of when each piece of the batch is put once (pieces between consecutive cuts)."""
    out = []
    for lo, hi in ranges:
        inner = sorted(c for c in set(cuts) if lo < c < hi)
        for a, b in zip([lo, *inner], [*inner, hi]):
            out.append((a, b))
    return out


def can_share_by_reference(spec: DispatchSpec, args: tuple) -> bool:
    """Whether a call can send its shares as `ShareRefs` (`plan_shared_calls`): a DP mode with declared reads whose
    first positional argument is a Batch."""
    return spec.mode in DP_MODES and spec.reads is not None and bool(args) and _is_batch(args[0])


def plan_shared_calls(
    spec: DispatchSpec,
    args: tuple,
    kwargs: dict,
    world_size: int,
    replica_of: list[int],
    piece: Callable[[str, Any, int, int], Any],
    cuts: Sequence[int] = (),
    method: str = "?",
    mini_batch_samples: Optional[int] = None,
) -> list[tuple[tuple, dict]]:
    """As `plan_calls` for a DP call whose first argument is a `Batch` with declared reads, but each replica's share
    is a `ShareRefs`: every key it reads, as the handles `piece(key, tensor, lo, hi)` gives for its rows cut at
    `cuts` (`cut_ranges`). A `piece` that returns the same handle for the same (key, tensor, lo, hi) puts each row
    piece once however many calls read it (`megarl.controller.shares.BatchShares`)."""
    if not can_share_by_reference(spec, args):
        raise DispatchError(f"{method}: shares by reference need a DP call with declared reads over a Batch")
    if replica_of is None or len(replica_of) != world_size:
        raise DispatchError(f"{method}: {spec.mode.name} needs the replica of each of the {world_size} ranks")
    data = select_reads(spec, args[0], method)
    per_replica = []
    for ranges, extra in share_rows(spec, len(data), max(replica_of) + 1, mini_batch_samples, method):
        pieces = cut_ranges(ranges, cuts)
        refs = ShareRefs({k: [piece(k, t, a, b) for a, b in pieces] for k, t in data.tensors.items()},
                         {**data.meta, **extra})
        per_replica.append(((refs,) + tuple(args[1:]), kwargs))
    return [per_replica[replica_of[r]] for r in range(world_size)]


class ResolvedPieces:
    """A worker's row pieces by reference (`TokenRowsPiece`) as its last two role calls resolved them: each rollout
    package fetched and each piece built, so a call whose share has the rows the previous call's had (the actor's
    update right after the reference's forward, the same DP share of the same step) fetches and builds nothing again.
    A package handle names an immutable object and a piece its rows, lengths and the controller's checksums, so a hit
    is the same value; a built piece is handed out as a copy (a role that changes its batch in place changes only its
    own). Entries that neither the current nor the previous call used are dropped: it holds at most two calls' pieces
    and their packages (host memory: about the token keys of two DP shares)."""

    def __init__(self) -> None:
        self._now: dict = {}
        self._before: dict = {}
        self.hits = 0  # pieces and packages served from here (tests count them)

    def next_call(self) -> None:
        """Start the next call: what the call before the last one used, and the current one did not, is dropped."""
        self._before, self._now = self._now, {}

    def get(self, key: Any) -> Any:
        for where in (self._now, self._before):
            if key in where:
                self._now[key] = where[key]
                self.hits += 1
                return where[key]
        return None

    def put(self, key: Any, value: Any) -> None:
        self._now[key] = value


def _piece_key(piece: Any) -> tuple:
    """What identifies a `TokenRowsPiece`'s rows: the key, the packages and slots they are in, their lengths, the
    batch's S and pad id, and the controller's checksums of the rows."""
    return ("piece", piece.key, tuple(piece.refs), tuple(piece.slots), tuple(piece.prompt_lens), tuple(piece.lengths),
            piece.seq_len, piece.pad_id, piece.packed, tuple(piece.checks.tolist()))


def resolve_shares(args: tuple, kwargs: dict, get: Callable[[list[Any]], list[Any]],
                   cache: Optional[ResolvedPieces] = None) -> tuple[tuple, dict]:
    """`args` / `kwargs` with each `ShareRefs` replaced by its `Batch` (on the worker): every handle fetched with one
    `get(handles)` (values in handle order; an `InlinePiece` came with the call and is used as is), each key's pieces
    concatenated on dim 0. A `TokenRowsPiece` handle is
    built from its rows' rollout packages (`megarl.data.token_rows`), fetched in the same `get`, each once; one whose
    rollout rank died raises `RolloutOutputLost` (`lost_completion`). `cache`: the worker's `ResolvedPieces`, which
    serves the row pieces and packages its previous call resolved (None: everything fetched and built)."""
    from megarl.data.batch import Batch

    found = [a for a in (*args, *kwargs.values()) if isinstance(a, ShareRefs)]
    if not found:
        return args, kwargs
    from megarl.data.token_rows import TokenRowsPiece, lost_completion

    if cache is not None:
        cache.next_call()
    handles = [h for s in found for hs in s.pieces.values() for h in hs]
    # a row piece by reference (`TokenRowsPiece`): its rows' rollout packages, each fetched once for all its keys
    plain = [h for h in handles if not isinstance(h, (TokenRowsPiece, InlinePiece))]
    by_reference = [h for h in handles if isinstance(h, TokenRowsPiece)]
    built: dict[int, Any] = {}  # id(piece) -> rows served by the cache
    if cache is not None:
        for h in by_reference:
            rows = cache.get(_piece_key(h))
            if rows is not None:
                built[id(h)] = rows.clone()
    packages = list(dict.fromkeys(r for h in by_reference if id(h) not in built for r in h.refs))
    package_of = {}
    if cache is not None:
        for r in packages:
            kept = cache.get(("package", r))
            if kept is not None:
                package_of[r] = kept
    missing = [r for r in packages if r not in package_of]
    try:
        fetched = get(plain + missing) if plain or missing else []
    except Exception as e:  # a package whose rollout rank died: our error, naming that rank and the rows
        lost = lost_completion(e, by_reference)
        if lost is None:
            raise
        raise lost from e
    value_of = dict(zip(map(id, plain), fetched[:len(plain)]))
    package_of.update(zip(missing, fetched[len(plain):]))
    if cache is not None:
        for r in missing:
            cache.put(("package", r), package_of[r])
    import torch

    def value(h: Any) -> Any:
        if isinstance(h, InlinePiece):
            return h.value
        if isinstance(h, TokenRowsPiece):
            if id(h) in built:
                return built[id(h)]
            rows = h.assemble([package_of[r] for r in h.refs])
            if cache is not None:
                cache.put(_piece_key(h), rows.clone())
            return rows
        return value_of[id(h)]

    batches = {}
    for s in found:
        tensors = {}
        for key, hs in s.pieces.items():
            parts = [value(h) for h in hs]
            tensors[key] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        batches[id(s)] = Batch(tensors, dict(s.meta))
    swap = lambda a: batches.get(id(a), a) if isinstance(a, ShareRefs) else a  # noqa: E731
    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}


# -- plan and collect ------------------------------------------------------------------------------------------------


def plan_calls(
    spec: DispatchSpec,
    args: tuple,
    kwargs: dict,
    world_size: int,
    replica_of: Optional[list[int]] = None,
    method: str = "?",
    mini_batch_samples: Optional[int] = None,
) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) each rank receives. `replica_of` (rank -> replica) is needed for the DP modes only;
    `mini_batch_samples` (the role's, None = the whole batch) for DP_SPLIT_MINI_BATCHES only."""
    mode = spec.mode
    if spec.reads is not None and mode not in DP_MODES and mode is not Dispatch.ALL_TO_ALL:
        if not args:
            raise DispatchError(f"{method}: declares the batch keys it reads; pass the batch as the first argument")
        args = (select_reads(spec, args[0], method),) + tuple(args[1:])
    if mode in (Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO, Dispatch.LAST_STAGE_FIRST_RESULT):
        return [(args, kwargs)] * world_size
    if mode is Dispatch.ALL_TO_ALL:
        for where, v in [(f"argument {i}", a) for i, a in enumerate(args)] + [(k, v) for k, v in kwargs.items()]:
            if not hasattr(v, "__len__") or not hasattr(v, "__getitem__") or len(v) != world_size:
                got = len(v) if hasattr(v, "__len__") else type(v).__name__
                raise DispatchError(
                    f"{method}: ALL_TO_ALL needs every argument to have {world_size} elements (one per rank); "
                    f"{where} has {got}"
                )
        return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world_size)]
    if mode in DP_MODES:
        if not args:
            raise DispatchError(f"{method}: {mode.name} needs the data to split as the first positional argument")
        if replica_of is None or len(replica_of) != world_size:
            raise DispatchError(f"{method}: {mode.name} needs the replica of each of the {world_size} ranks")
        n = max(replica_of) + 1
        data = select_reads(spec, args[0], method)
        if mode is Dispatch.DP_SPLIT:
            chunks = split_contiguous(data, n, method)
        else:
            chunks = split_mini_batches(data, n, mini_batch_samples, method)
        per_replica = [((chunk,) + tuple(args[1:]), kwargs) for chunk in chunks]  # ranks of a replica share one
        return [per_replica[replica_of[r]] for r in range(world_size)]
    raise DispatchError(f"{method}: unknown dispatch mode {mode!r}")


def collect(spec: DispatchSpec, results: list[Any], replica_of: Optional[list[int]] = None) -> Any:
    """The controller's return value from the per-rank results (rank order)."""
    mode = spec.mode
    if mode in (Dispatch.ONE_TO_ALL, Dispatch.ALL_TO_ALL):
        return list(results)
    if mode in (Dispatch.RANK_ZERO, Dispatch.DP_SPLIT_MINI_BATCHES):
        return results[0]
    if mode is Dispatch.LAST_STAGE_FIRST_RESULT:
        return next((r for r in results if r is not None), None)
    if mode is Dispatch.DP_SPLIT:
        assert replica_of is not None
        n = max(replica_of) + 1
        per_replica: list[Any] = [None] * n
        for rank, res in enumerate(results):
            if res is not None and per_replica[replica_of[rank]] is None:
                per_replica[replica_of[rank]] = res
        return concat_results(per_replica)
    raise ValueError(f"unknown dispatch mode {mode!r}")
