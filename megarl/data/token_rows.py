"""A step's token rows by reference: the rollout ranks keep each finished completion, the training ranks build their
rows of the batch's token keys from it, and the controller sends only references and a small layout.

    rollout host (server_poll)  : per poll round, its finished completions c_0..c_{n-1}:
                                  ids_round = pack_round([ids_k]), log_probs_round = pack_round([log_probs_k])
                                  (ids_k, log_probs_k = pack_completion(...)), one ray.put each, and
                                  attach_ref(c_k, (ids_round ref, log_probs_round ref, k, rollout_rank))
    controller (RLLoop.step)    : rows = TokenRowSource.from_trajectories(trajectories, batch, pad_id)
                                  with BatchShares(...) as shares: shares.by_reference(rows); role calls as before
    training rank (resolve_shares): fetches what its keys need of its rows (each object once) and builds input_ids,
                                  attention_mask, loss_mask, rollout_log_probs of its share -- bit-identical to
                                  `trajectories_to_batch`

The controller still receives every completion's ids and log-probs once (generation's output: it decodes them and
computes the rewards); what no longer crosses is the padded [B, S] batch going back down. Each `TokenRowsPiece` (one
key's rows [lo, hi) of one call's share) carries, per row, the prompt and total lengths, a checksum of the controller's
own row of that key, and the round object the key is built from with the row's slot in it: input_ids from the
completion's ids [P + R] int64, rollout_log_probs from its log-probs [R] float32, the two masks from the lengths alone
(nothing fetched). Two objects per poll round and replica, not per completion (a `ray.put` costs ~1 ms on a small
host): a rank deserialises the rounds its rows are in -- with them the rows of other DP shares that came back in the
same poll round (`benchmarks/dispatch_bytes.py` counts them) -- and of those only the keys its method reads need. The rank compares each row it
built with the checksum and raises on any difference: a sample changed on the controller after generation can never
be trained on in its old form. A completion whose rollout rank died before a training rank fetched it (Ray: the
object's owner died) raises `RolloutOutputLost` (`lost_completion`), naming that rollout rank and the rows. Only rows that are exactly one completion (prompt + response, loss mask 1 on the
response) have references: multi-turn episodes (observation tokens inserted on the controller), samples replaced or
rebuilt on the controller (`dataclasses.replace` drops the attribute) and samples restored from a checkpoint have
none. A batch with any such row is rows the controller built (`TokenRowSource.from_rows`): each piece of its rows
(ids, log-probs, loss masks, unpadded) is put once as one object (`pack_rows`) that every key and call reading those
rows references -- one crossing instead of four keys by value -- and the ranks rebuild the four keys from it, checked
the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

# The batch keys built from the references (`trajectories_to_batch`'s layout of a single-turn row).
TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "rollout_log_probs")
# which of a completion's two objects (0: ids, 1: log-probs) each key is built from; None: from the lengths alone
_SOURCE_OF = {"input_ids": 0, "rollout_log_probs": 1, "attention_mask": None, "loss_mask": None}
REF_ATTR = "token_ref"  # the attribute (not a dataclass field: `replace` and checkpoints drop it) holding the refs


class RolloutOutputLost(RuntimeError):
    """A training rank could not fetch a completion the rollout ranks kept (`fetch_completions`): the rollout rank
    that owned it died, or its node was lost, between generation and the role call."""


def pack_completion(prompt_ids: Sequence[int], token_ids: Sequence[int],
                    log_probs: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a rollout host puts for one finished completion, as two objects: ids [P + R] int64 (prompt then
    response) and log_probs [R] float32 (converted as `trajectories_to_batch` converts them)."""
    return (torch.tensor(list(prompt_ids) + list(token_ids), dtype=torch.long),
            torch.tensor([float(x) for x in log_probs], dtype=torch.float32))


def pack_round(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One poll round's rows of one kind (all ids, or all log-probs) as one object: (values [sum of lengths], the
    concatenated rows; offsets [n + 1] int64, row k is values[offsets[k]:offsets[k + 1]])."""
    lengths = torch.tensor([0] + [len(r) for r in rows], dtype=torch.long)
    return torch.cat(list(rows)) if rows else torch.zeros(0), lengths.cumsum(0)


# where each key's rows are in a `pack_rows` object
PACKED_INDEX = {"input_ids": 0, "rollout_log_probs": 1, "loss_mask": 2}


def pack_rows(input_ids: torch.Tensor, rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor,
              lengths: Sequence[int]) -> tuple:
    """Rows of a batch the controller built (each row's first `lengths[i]` tokens; the rest is padding) as one
    object: (ids, log-probs, loss masks), each a `pack_round` of the unpadded rows (int64, float32, uint8)."""
    def pack(t, dtype):
        return pack_round([t[i, :n].to(dtype) for i, n in enumerate(lengths)])
    return (pack(input_ids, torch.long), pack(rollout_log_probs, torch.float32), pack(loss_mask, torch.uint8))


def round_row(round_object: tuple[torch.Tensor, torch.Tensor], slot: int) -> torch.Tensor:
    """Row `slot` of a `pack_round` object."""
    values, offsets = round_object
    return values[int(offsets[slot]):int(offsets[slot + 1])]


def token_ref(obj: Any) -> Any:
    """The (ids round ref, log-probs round ref, slot in them, rollout rank that put them) attached to a completion, sample or trajectory, or None."""
    return getattr(obj, REF_ATTR, None)


def attach_ref(obj: Any, ref: Any) -> Any:
    """`obj` (a frozen dataclass or not) with `ref` attached as a plain attribute; returns `obj`."""
    if ref is not None:
        object.__setattr__(obj, REF_ATTR, ref)
    return obj


def row_checks(tensor: torch.Tensor) -> torch.Tensor:
    """[rows] int64: each row's sum of its elements' bit patterns (float32 as int32, int64 as is) -- what a rank's
    built row must match."""
    if tensor.dtype == torch.float32:
        tensor = tensor.view(torch.int32)
    return tensor.long().sum(-1)


@dataclasses.dataclass
class TokenRowsPiece:
    """One key's rows [lo, hi) of a share, by reference (the handle `BatchShares.piece` gives instead of an object
    ref): `refs[i]` the round object (`pack_round`) row lo + i is built from and `slots[i]` its row in it (both
    empty for the masks, built from the lengths), `prompt_lens`
    / `lengths` its prompt and total tokens, `checks` the controller's `row_checks` of those rows; `seq_len` S and
    `pad_id` of the batch; `owners[i]` the rollout rank that put `refs[i]` (its host's rank in its worker group: the
    first rank of its vLLM replica), for the error when it is gone."""

    key: str
    refs: list
    prompt_lens: list[int]
    lengths: list[int]
    checks: torch.Tensor
    seq_len: int
    pad_id: int
    owners: list[int] = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)
    # the rows were put by the controller (`TokenRowSource.from_rows`: rows it built itself, e.g. multi-turn episodes):
    # refs[i] is one object (`pack_rows`) holding the piece's ids, log-probs and loss masks, unpadded, for every key
    packed: bool = False

    def assemble(self, fetched: Sequence[torch.Tensor]) -> torch.Tensor:
        """[hi - lo, S] of this key, laid out as `trajectories_to_batch`, from the fetched objects of `refs` (in
        order: a round object per row, the same object for the rows of one round); raises ValueError naming the key and row when a row differs from the controller's (`checks`)."""
        rows, S = len(self.lengths), self.seq_len
        if self.key == "input_ids":
            out = torch.full((rows, S), self.pad_id, dtype=torch.long)
        elif self.key == "rollout_log_probs":
            out = torch.zeros((rows, S), dtype=torch.float32)
        elif self.key in ("attention_mask", "loss_mask"):
            out = torch.zeros((rows, S), dtype=torch.long)
        else:
            raise ValueError(f"TokenRowsPiece: no layout for key {self.key!r}; keys by reference: {TOKEN_KEYS}")
        for i, (p, n) in enumerate(zip(self.prompt_lens, self.lengths)):
            if self.packed and self.key != "attention_mask":
                part = round_row(fetched[i][PACKED_INDEX[self.key]], self.slots[i])
                if len(part) != n:
                    raise ValueError(f"{self.key} row {i}: the controller's packed row has {len(part)} values but the "
                                     f"row has {n} tokens")
                out[i, :n] = part
            elif self.key == "attention_mask":
                out[i, :n] = 1
            elif self.key == "loss_mask":
                out[i, p:n] = 1
            else:
                part = round_row(fetched[i], self.slots[i])
                want = n if self.key == "input_ids" else n - p
                if len(part) != want:
                    raise ValueError(f"{self.key} row {i}: the rollout kept {len(part)} values but the controller's "
                                     f"row has {want} (prompt {p}, {n} tokens)")
                out[i, (0 if self.key == "input_ids" else p):n] = part
        got = row_checks(out)
        if not torch.equal(got, self.checks):
            bad = int((got != self.checks).nonzero()[0])
            raise ValueError(f"{self.key} row {bad} of this share, built from the rollout's completion, differs from "
                             "the controller's row: the sample was changed after generation; send the batch by value "
                             "(no token reference on the sample)")
        return out


def lost_completion(error: BaseException, pieces: Sequence[TokenRowsPiece]) -> Optional[RolloutOutputLost]:
    """The `RolloutOutputLost` to raise instead of `error` -- raised by the training rank's fetch of its share
    (`resolve_shares`) -- when `error` is Ray's for an object that can no longer be fetched
    (`ray.exceptions.ObjectLostError`: its owner, the rollout rank's actor, died, or every copy's node went away) and
    that object is a completion of `pieces`: naming the rollout rank, the key and the rows. Else None."""
    lost_hex = getattr(error, "object_ref_hex", None)
    if lost_hex is None or not _is_object_lost(error):
        return None
    for p in pieces:
        rows = [i for i, r in enumerate(p.refs) if r.hex() == lost_hex]
        if rows:
            owner = p.owners[rows[0]] if len(p.owners) > rows[0] else "?"
            why = ("that rollout worker died" if type(error).__name__ == "OwnerDiedError" else
                   "the object store lost it: its node went away, or it was freed")
            return RolloutOutputLost(
                f"{p.key}, rows {rows} of this rank's piece: the completion kept by rollout rank {owner} (the first "
                f"rank of its vLLM replica) is gone ({type(error).__name__}: {why} after generating this step and "
                "before the training ranks fetched its output). This step's batch cannot be built: find the cause "
                "(Ray's error, chained as its cause, names the worker's log), then resume the run from its last "
                "checkpoint (`megarl train CONFIG checkpoint.resume=true`)")
    return None


def _is_object_lost(e: BaseException) -> bool:
    """Whether `e` is Ray's error for an object that can no longer be fetched (owner died, all copies lost)."""
    try:
        from ray.exceptions import ObjectLostError
    except ImportError:  # not under Ray: no object can be lost
        return False
    return isinstance(e, ObjectLostError)


@dataclasses.dataclass
class TokenRowSource:
    """The batch's token keys as the rollout's completions: per row its `token_ref`, prompt and total
    lengths; the batch's tensors of TOKEN_KEYS (by identity: `BatchShares` replaces only pieces of these very tensors,
    unchanged in place since, `versions`)."""

    refs: list
    prompt_lens: list[int]
    lengths: list[int]
    tensors: dict[str, torch.Tensor]
    pad_id: int
    versions: dict[str, int]  # the tensors' in-place version counters when the source was made

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Any], batch: Any, pad_id: int) -> Optional["TokenRowSource"]:
        """The source of `batch` (`trajectories_to_batch(trajectories, pad_id)`), or None unless every trajectory is
        exactly one completion with references (`token_ref`: single-turn, unchanged since generation)."""
        refs = [token_ref(t) for t in trajectories]
        if not refs or any(r is None for r in refs):
            return None
        for t in trajectories:  # one completion: context then response, the whole response trained on
            p = t.prompt_len
            if list(t.loss_mask) != [0] * p + [1] * (len(t) - p):
                return None
        tensors = {k: batch.tensors[k] for k in TOKEN_KEYS if k in batch.tensors}
        return cls(refs, [t.prompt_len for t in trajectories], [len(t) for t in trajectories], tensors, pad_id,
                   {k: v._version for k, v in tensors.items()})

    # rows the controller built (`from_rows`): per piece [lo, hi), the ref of its `pack_rows` object, put once
    packed: Optional[dict] = None
    put_bytes: int = 0  # tensor bytes of the packed objects put
    put: Optional[Any] = None  # how a packed object is put (default `ray.put`)

    @classmethod
    def from_rows(cls, batch: Any, pad_id: int, put: Optional[Any] = None) -> Optional["TokenRowSource"]:
        """The source of a batch whose rows the controller built itself (multi-turn episodes: observation tokens
        inserted between the turns; samples restored from a checkpoint or changed after generation: no references):
        each piece's ids, log-probs and loss masks, unpadded, are `ray.put` once as one object (`pack_rows`), which
        every key of every call reading those rows references -- the rows cross once, and a rank fetches only the
        pieces of its share; attention_mask is built from the lengths. None unless the batch has all four keys and
        every attention mask is a prefix of ones (`trajectories_to_batch`'s layout). `put`: value -> handle (default
        `ray.put`)."""
        if any(k not in batch.tensors for k in TOKEN_KEYS):
            return None
        attention = batch.tensors["attention_mask"]
        lengths = attention.sum(-1)
        prefix = torch.arange(attention.shape[1])[None, :] < lengths[:, None]
        if not torch.equal(attention.bool(), prefix):
            return None
        tensors = {k: batch.tensors[k] for k in TOKEN_KEYS}
        return cls([], [0] * len(lengths), [int(n) for n in lengths], tensors, pad_id,
                   {k: v._version for k, v in tensors.items()}, packed={}, put=put)

    def piece(self, key: str, tensor: torch.Tensor, lo: int, hi: int) -> Optional[TokenRowsPiece]:
        """The by-reference handle of `tensor[lo:hi]` when `tensor` is this source's `key`, not changed in place since
        (its version counter), else None (it goes by value). From `from_rows`: the first handle of a piece puts its
        `pack_rows` object (`ray.put`)."""
        if self.tensors.get(key) is not tensor or tensor._version != self.versions[key]:
            return None
        if self.packed is not None:
            return self._packed_piece(key, tensor, lo, hi)
        which = _SOURCE_OF[key]
        rows = [] if which is None else self.refs[lo:hi]
        return TokenRowsPiece(key, [r[which] for r in rows], self.prompt_lens[lo:hi], self.lengths[lo:hi],
                              row_checks(tensor[lo:hi]), tensor.shape[1], self.pad_id, [r[3] for r in rows],
                              [r[2] for r in rows])

    def _packed_piece(self, key: str, tensor: torch.Tensor, lo: int, hi: int) -> TokenRowsPiece:
        if any(self.tensors[k]._version != self.versions[k] for k in self.tensors):
            raise ValueError(f"TokenRowSource: a token key of the batch was changed in place after the source was "
                             f"made; make the source after the batch is final ({key} rows [{lo}, {hi}))")
        if (lo, hi) not in self.packed:
            if self.put is None:
                import ray

                self.put = ray.put
            t = self.tensors
            obj = pack_rows(t["input_ids"][lo:hi], t["rollout_log_probs"][lo:hi], t["loss_mask"][lo:hi],
                            self.lengths[lo:hi])
            self.put_bytes += sum(v.numel() * v.element_size() for pair in obj for v in pair)
            self.packed[(lo, hi)] = self.put(obj)
        ref = self.packed[(lo, hi)]
        n = hi - lo
        return TokenRowsPiece(key, [ref] * n, self.prompt_lens[lo:hi], self.lengths[lo:hi], row_checks(tensor[lo:hi]),
                              tensor.shape[1], self.pad_id, [], list(range(n)), packed=True)
