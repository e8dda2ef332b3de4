"""A step's batch put into the object store once: each DP share of each key, referenced by every role call of the step.

    with BatchShares([(actor_group, "compute_log_probs"), (ref_group, "compute_ref_log_probs"),
                      (actor_group, "update_actor")]):
        actor_group.compute_log_probs(batch)        # input_ids, masks: each row piece ray.put once ...
        ref_group.compute_ref_log_probs(batch)      # ... and only referenced again here
        actor_group.update_actor(batch.update(...)) # the new keys are put; the token ids are not

Inside the block, a `WorkerGroup` call whose method is DP_SPLIT / DP_SPLIT_MINI_BATCHES with declared reads over a
`Batch` sends each replica a `megarl.controller.dispatch.ShareRefs` instead of a copy of its rows: for every key it
reads, the object refs of the row pieces of its share. A piece is one key's rows [lo, hi) between two consecutive
*cuts*: the union of the share boundaries of every (group, method) declared (`WorkerGroup.share_bounds`), so each
call's share is a whole number of pieces -- the actor's contiguous forward share and its per-mini-batch update share
alike. Each piece is `ray.put` once per block (keyed by the tensor object, its in-place version counter and the
rows), so a key crosses from the controller once, however many calls read it; a rank still deserialises only its
share of the keys its method reads (`_WorkerHost.call` fetches and concatenates its pieces). A call of a method not
declared still works: its boundaries are added to its own pieces (put again where they cut a declared piece).

The block is per thread (another thread's calls, e.g. an async rollout driver's, are unaffected); leaving it drops the
controller's references (calls in flight keep theirs: Ray counts the refs nested in their arguments).
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

from megarl.controller.dispatch import InlinePiece

_active = threading.local()
# A piece of a one-dimensional key ([rows]: advantages, scores, group ids) of at most this many bytes goes with each
# call that reads it (`InlinePiece`) instead of into the object store: a `ray.put` on the controller and a fetch on
# the rank cost ~1-2 ms each on a small host, more than sending a few hundred bytes again; Ray inlines task
# arguments below 100 KiB itself. Token-sized keys ([rows, S] and up) are always put once, so they cross once.
INLINE_PIECE_BYTES = 16 * 1024


def active_shares() -> Optional["BatchShares"]:
    """The `BatchShares` block this thread is in, or None."""
    return getattr(_active, "shares", None)


class BatchShares:
    """Put each row piece of each batch key once for the calls of one block (see the module docstring).

    Args:
        calls: (worker group, method name) of every DP call the block makes with a batch: their share boundaries
            are where the pieces are cut (asked of each group once per row count; cached by the groups).
        inline_bytes: a piece of a one-dimensional key of at most this many bytes goes with the calls instead of
            being put (`INLINE_PIECE_BYTES`; 0: every piece is put).

    Attributes (for reports and tests): `puts` -- pieces put so far; `put_bytes` -- their tensor bytes;
    `inline_pieces` / `inline_bytes_sent` -- small one-dimensional pieces sent with the calls instead, and their bytes;
    `keys_put` -- the keys with at least one piece put, in order of first put. What token-sized data (a tensor of
    two or more dims: [B, S] and up) crossed the controller inside the block, counted from what really moved:
    `token_tensors_down` -- (key, tensor id) of each such tensor with a piece put (a key put again as a new tensor,
    e.g. a loss mask changed after the first call, counts again); `token_results_up` -- (method, key) of each such
    tensor a call inside the block returned to the controller (`note_result`, by `PendingCall.result`).
    `by_reference_pieces` / `keys_by_reference` -- pieces sent as references to the rollout's packages instead of
    put (`by_reference`): they do not cross. `packed_pieces` -- pieces of rows the controller built itself
    (`TokenRowSource.from_rows`, e.g. multi-turn episodes): each piece's ids, log-probs and loss masks are one object
    put once for every key and call reading them, counted in `token_tensors_down` as one token-sized crossing
    ("token_rows") however many keys and pieces; `packed_put_bytes` -- their tensor bytes.
    """

    def __init__(self, calls: Sequence[tuple[Any, str]], inline_bytes: int = INLINE_PIECE_BYTES) -> None:
        for group, method in calls:
            if method not in getattr(group, "methods", ()):
                raise ValueError(f"BatchShares: {group!r} has no dispatch method {method!r}; it has "
                                 f"{getattr(group, 'methods', [])}")
        self.calls = list(calls)
        self.inline_bytes = inline_bytes
        self._cuts: dict[int, list[int]] = {}
        self._refs: dict[tuple, Any] = {}
        self._held: dict[int, Any] = {}  # the tensors pieces were cut from: their ids stay theirs
        self.puts = 0
        self.put_bytes = 0
        self.inline_pieces = 0  # pieces sent with the calls (`InlinePiece`), each counted once
        self.inline_bytes_sent = 0  # their tensor bytes, once per piece
        self.keys_put: list[str] = []
        self.token_tensors_down: list[tuple[str, int]] = []
        self.token_results_up: list[tuple[str, str]] = []
        self._source: Any = None  # by_reference
        self.by_reference_pieces = 0
        self.packed_pieces = 0
        self._packed_bytes = 0
        self.keys_by_reference: list[str] = []
        self._outer: Optional[BatchShares] = None

    def cuts(self, rows: int) -> list[int]:
        """Every share boundary of the declared calls over a batch of `rows` rows (sorted)."""
        if rows not in self._cuts:
            points = {0, rows}
            for group, method in self.calls:
                points.update(group.share_bounds(method, rows))
            self._cuts[rows] = sorted(points)
        return self._cuts[rows]

    def by_reference(self, source: Any) -> None:
        """Send the pieces of `source`'s tensors (a `megarl.data.token_rows.TokenRowSource`: the step's token
        keys as the rollout ranks' packages) as `TokenRowsPiece` handles instead of putting them: the ranks build
        them. None: nothing by reference."""
        self._source = source

    def piece(self, key: str, tensor: Any, lo: int, hi: int) -> Any:
        """The object ref of `tensor[lo:hi]` (a compact copy), put on first use; for a tensor of the `by_reference`
        source, its `TokenRowsPiece` (nothing put: counted in `by_reference_pieces`); for a small piece of a
        one-dimensional key (at most `inline_bytes`), an `InlinePiece` sent with each call (counted in
        `inline_pieces`)."""
        import ray

        index = (key, id(tensor), tensor._version, lo, hi)
        ref = self._refs.get(index)
        if ref is None and self._source is not None:
            ref = self._source.piece(key, tensor, lo, hi)
            if ref is not None:
                self._refs[index] = ref
                self._held[id(tensor)] = tensor
                if getattr(ref, "packed", False):  # rows the controller built, put once for all their keys
                    self.packed_pieces += 1
                    if ("token_rows", id(self._source)) not in self.token_tensors_down:
                        self.token_tensors_down.append(("token_rows", id(self._source)))
                else:
                    self.by_reference_pieces += 1
                if key not in self.keys_by_reference:
                    self.keys_by_reference.append(key)
        if ref is None:
            part = tensor[lo:hi].clone()  # a view would pickle its whole storage
            self._held[id(tensor)] = tensor
            nbytes = part.numel() * part.element_size()
            if part.dim() == 1 and nbytes <= self.inline_bytes:
                ref = self._refs[index] = InlinePiece(part)
                self.inline_pieces += 1
                self.inline_bytes_sent += nbytes
                return ref
            ref = self._refs[index] = ray.put(part)
            self.puts += 1
            self.put_bytes += nbytes
            if key not in self.keys_put:
                self.keys_put.append(key)
            if part.dim() >= 2 and (key, id(tensor)) not in self.token_tensors_down:
                self.token_tensors_down.append((key, id(tensor)))
        return ref

    @property
    def packed_put_bytes(self) -> int:
        return int(getattr(self._source, "put_bytes", 0) or 0) if self._source is not None else self._packed_bytes

    def note_result(self, method: str, result: Any) -> None:
        """Count the token-sized tensors (two or more dims) of a call's collected `result` (a `Batch`, or anything
        else: nothing counted) that came up to the controller inside this block."""
        tensors = getattr(result, "tensors", None)
        if isinstance(tensors, dict):
            self.token_results_up += [(method, k) for k, v in tensors.items() if getattr(v, "dim", lambda: 0)() >= 2]

    def __enter__(self) -> "BatchShares":
        self._outer = active_shares()
        _active.shares = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.shares = self._outer
        self._refs.clear()
        self._held.clear()
        self._packed_bytes = self.packed_put_bytes
        self._source = None
