"""The step's token keys by reference (issue 30, item 1): a training rank builds its share's input_ids,
attention_mask, loss_mask and rollout_log_probs from the rollout's poll-round packages, through the controller's
real cut (`plan_shared_calls` with `RoleHost`'s dispatch specs) and the worker's `resolve_shares`. Expected: the
controller's own batch (`trajectories_to_batch`, the by-value path), bit for bit. The object store is stood in for by
a dict (handle -> value): `resolve_shares` takes its `get` as a parameter; the Ray path runs in the e2e quickstart."""

import dataclasses

import pytest
import torch

from megarl.controller.dispatch import dispatched_methods, plan_shared_calls, resolve_shares, share_rows
from megarl.data.batch import Batch
from megarl.data.token_rows import (
    TOKEN_KEYS,
    TokenRowSource,
    TokenRowsPiece,
    attach_ref,
    pack_completion,
    pack_round,
    token_ref,
)
from megarl.data.trajectory import Trajectory, trajectories_to_batch
from megarl.rollout.engine import Completion, GenerationOutput
from megarl.trainer.samples import samples_to_trajectories
from megarl.workers.role_host import RoleHost

PAD = 7


class Store:
    """handle -> value: what `ray.put` / `ray.get` do for these tests."""

    def __init__(self):
        self.values: dict[str, object] = {}
        self.gets: list[list] = []

    def put(self, value) -> str:
        handle = f"ref{len(self.values)}"
        self.values[handle] = value
        return handle

    def get(self, handles: list) -> list:
        self.gets.append(list(handles))
        return [self.values[h] for h in handles]


def _outputs(store: Store) -> list[GenerationOutput]:
    """4 prompts x 2 completions of ragged lengths, put as the rollout host puts a poll round's: two poll rounds,
    prompts 0 and 2 (rollout rank 0) and prompts 1 and 3 (rank 1), each round's ids and log-probs one object each
    (`pack_round`), so a round holds rows of more than one DP share."""
    g = torch.Generator().manual_seed(0)
    outs, rounds = [], {0: [], 1: []}  # rollout rank -> [(completion, ids, log_probs)] of its round
    for i in range(4):
        prompt = torch.randint(10, 90, (2 + i,), generator=g).tolist()
        comps = []
        for k in range(2):
            n = 1 + (3 * i + 5 * k) % 6
            c = Completion(k, torch.randint(10, 90, (n,), generator=g).tolist(),
                           (-torch.rand(n, generator=g, dtype=torch.float64)).tolist(), "stop")
            rounds[i % 2].append((c, *pack_completion(prompt, c.token_ids, c.log_probs)))
            comps.append(c)
        outs.append(GenerationOutput(f"r{i}", prompt, comps, True))
    for owner, kept in rounds.items():
        ids_ref = store.put(pack_round([k[1] for k in kept]))
        log_probs_ref = store.put(pack_round([k[2] for k in kept]))
        for slot, (c, _, _) in enumerate(kept):
            attach_ref(c, (ids_ref, log_probs_ref, slot, owner))
    return outs


def _step(store: Store):
    samples = [s for i, out in enumerate(_outputs(store)) for s in out.samples(i)]
    trajectories = samples_to_trajectories(samples, policy_version=3, uid_prefix="1/")
    batch = trajectories_to_batch(trajectories, pad_id=PAD)
    return trajectories, batch


def _shares(method: str, batch: Batch, source, store: Store, world=4, replicas=(0, 0, 1, 1), mini=4):
    spec = dispatched_methods(RoleHost)[method]
    m = mini if method == "update_actor" else None
    cuts = sorted({x for ranges, _ in share_rows(spec, len(batch), max(replicas) + 1, m) for r in ranges for x in r})

    def piece(key, tensor, lo, hi):
        return source.piece(key, tensor, lo, hi) or store.put(tensor[lo:hi].clone())

    calls = plan_shared_calls(spec, (batch,), {}, world, list(replicas), piece, cuts, method, mini_batch_samples=m)
    return [resolve_shares(args, kwargs, store.get)[0][0] for args, kwargs in calls], calls


@pytest.mark.parametrize("method", ["compute_log_probs", "compute_ref_log_probs", "update_actor"])
def test_each_rank_builds_exactly_the_rows_the_controller_would_have_sent(method):
    store = Store()
    trajectories, batch = _step(store)
    source = TokenRowSource.from_trajectories(trajectories, batch, PAD)
    assert source is not None
    got, calls = _shares(method, batch, source, store)
    for args, _ in calls:  # none of the token keys was put: each piece references the rows' packages
        pieces = args[0].pieces
        assert {k for k in pieces if k in TOKEN_KEYS} and all(
            isinstance(h, TokenRowsPiece) for k in TOKEN_KEYS if k in pieces for h in pieces[k])
    want = _shares(method, batch, _NoSource(), Store())[0]  # the by-value path
    for share, by_value in zip(got, want):
        assert sorted(share.keys()) == sorted(by_value.keys())
        for key in share.keys():
            a, b = share[key], by_value[key]
            assert a.dtype == b.dtype and a.shape == b.shape, key
            same = torch.equal(a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 else \
                torch.equal(a, b)
            assert same, (method, key)
    # each rank fetched each object it needs once, and only the rounds of its own rows, only for the keys it reads:
    # ids for input_ids, log-probs only where rollout_log_probs is read, nothing for the masks (built from the lengths)
    reads_log_probs = "rollout_log_probs" in got[0].keys()
    for args, _ in calls:  # the masks are built from the lengths alone: nothing to fetch
        for key in ("attention_mask", "loss_mask"):
            assert all(h.refs == [] for h in args[0].pieces[key]), key
    for (args, _), fetched in zip(calls, store.gets):
        assert len(fetched) == len(set(fetched))
        rounds = {r for h in args[0].pieces["input_ids"] for r in h.refs}  # the ids rounds of this rank's rows
        assert rounds <= set(fetched)
        assert len(fetched) == len(rounds) * (2 if reads_log_probs else 1) + sum(
            1 for k, hs in args[0].pieces.items() if k not in TOKEN_KEYS for _ in hs)


class _NoSource:
    def piece(self, *_):
        return None


def test_the_update_after_the_reference_forward_fetches_and_builds_nothing_again():
    """A worker's `ResolvedPieces` across its calls of one step, as the rank runs them: the reference's forward
    (DP_SPLIT) then the actor's update (DP_SPLIT_MINI_BATCHES) over the same batch, on one rank of a DP2 layout whose
    update share is one mini-batch (the rows of its forward share). Expected: the update's token keys bit for bit
    what the uncached path builds, none of their packages fetched again (only the update's plain pieces), a change
    the first call made to its batch in place not seen by the second, and nothing kept of calls before the
    previous one. Fails if the cache is not consulted, serves another piece's rows, or hands out its own tensors."""
    from megarl.controller.dispatch import ResolvedPieces

    store = Store()
    trajectories, batch = _step(store)
    source = TokenRowSource.from_trajectories(trajectories, batch, PAD)
    batch.tensors["advantages"] = torch.linspace(-1, 1, len(batch)).float()
    plans = {m: _shares(m, batch, source, store, world=2, replicas=(0, 1), mini=len(batch))[1]
             for m in ("compute_ref_log_probs", "update_actor")}
    cache, rank = ResolvedPieces(), 0
    ref_args, ref_kwargs = plans["compute_ref_log_probs"][rank]
    store.gets.clear()
    ref_share = resolve_shares(ref_args, ref_kwargs, store.get, cache)[0][0]
    first = set(store.gets[0])  # the packages of this rank's rows
    assert first
    ref_share.tensors["input_ids"].fill_(-5)  # the forward's own copy, changed in place
    upd_args, upd_kwargs = plans["update_actor"][rank]
    store.gets.clear()
    got = resolve_shares(upd_args, upd_kwargs, store.get, cache)[0][0]
    want = resolve_shares(upd_args, upd_kwargs, Store.get.__get__(store))[0][0]  # no cache: fetched and built
    assert not first & set(store.gets[0]), "the update fetched packages the forward had fetched"
    for key in want.keys():
        a, b = got[key], want[key]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                                                  b.view(torch.int32) if b.dtype == torch.float32 else b), key
    assert not (got["input_ids"] == -5).any()
    assert cache.hits > 0
    # two calls later (a call over other rows in between), nothing of the first is kept
    other_args, other_kwargs = plans["compute_ref_log_probs"][1]
    resolve_shares(other_args, other_kwargs, store.get, cache)
    resolve_shares(other_args, other_kwargs, store.get, cache)
    store.gets.clear()
    resolve_shares(ref_args, ref_kwargs, store.get, cache)
    assert store.gets and store.gets[0], "pieces of a call before the previous one were still kept"


def test_a_sample_changed_after_generation_is_caught_on_the_rank():
    store = Store()
    trajectories, batch = _step(store)
    source = TokenRowSource.from_trajectories(trajectories, batch, PAD)
    # the controller's row differs from what the rollout kept (as a sample edited after generation would)
    batch.tensors["input_ids"][1, 0] += 1
    source.versions["input_ids"] = batch.tensors["input_ids"]._version  # as if the batch had been built so
    with pytest.raises(ValueError, match="input_ids row 1 .* differs from the controller's row"):
        _shares("compute_ref_log_probs", batch, source, store)


def test_only_untouched_single_completion_rows_go_by_reference():
    store = Store()
    trajectories, batch = _step(store)
    # a tensor changed in place after the source was made goes by value
    source = TokenRowSource.from_trajectories(trajectories, batch, PAD)
    batch.tensors["loss_mask"][0, -1] = 0
    assert source.piece("loss_mask", batch.tensors["loss_mask"], 0, 2) is None
    assert source.piece("input_ids", batch.tensors["input_ids"], 0, 2) is not None
    # a replaced sample loses its reference (dataclasses.replace copies fields only), so the batch goes by value
    edited = [dataclasses.replace(trajectories[0], token_ids=list(trajectories[0].token_ids))] + trajectories[1:]
    assert token_ref(edited[0]) is None
    assert TokenRowSource.from_trajectories(edited, batch, PAD) is None
    # a multi-turn row (context tokens inside the response) has no package
    t = max(trajectories, key=lambda x: len(x) - x.prompt_len)
    assert len(t) - t.prompt_len >= 3
    gap = t.prompt_len + 1  # an observation token inside the response
    mask, log_probs, versions = list(t.loss_mask), list(t.log_probs), list(t.policy_version)
    mask[gap], log_probs[gap], versions[gap] = 0, 0.0, -1
    multi = attach_ref(Trajectory(t.token_ids, t.prompt_len, mask, log_probs, versions, t.uid, t.group_uid,
                                  t.finish_reason), token_ref(t))
    assert TokenRowSource.from_trajectories([multi] + trajectories[1:], batch, PAD) is None
    assert set(TOKEN_KEYS) <= set(batch.keys())


def test_a_lost_completion_names_its_rollout_rank_and_rows():
    """Ray's error for an object that cannot be fetched becomes RolloutOutputLost naming the key, the rows of the
    piece and the rollout rank that put it; an error about another object, or not about a lost object, is left
    alone (None). Ray's own exception values, no Ray runtime: that a killed owner's object raises OwnerDiedError on
    the fetch is Ray's (its own tests)."""
    from ray.exceptions import GetTimeoutError, OwnerDiedError

    from megarl.data.token_rows import RolloutOutputLost, lost_completion

    refs = [bytes([i]) * 4 for i in range(3)]  # anything with .hex(): the object ids of three rows' ids
    piece = TokenRowsPiece("input_ids", refs, [1, 1, 1], [2, 2, 2], torch.zeros(3, dtype=torch.long), 2, 0,
                           owners=[0, 2, 2])
    masks = TokenRowsPiece("loss_mask", [], [1, 1, 1], [2, 2, 2], torch.zeros(3, dtype=torch.long), 2, 0)
    lost = lost_completion(OwnerDiedError(refs[2].hex(), None, ""), [masks, piece])
    assert isinstance(lost, RolloutOutputLost)
    assert "input_ids, rows [2] of this rank's piece" in str(lost) and "rollout rank 2" in str(lost)
    assert "OwnerDiedError: that rollout worker died" in str(lost) and "checkpoint.resume=true" in str(lost)
    assert lost_completion(OwnerDiedError((b"x" * 4).hex(), None, ""), [piece]) is None  # not one of these rows
    assert lost_completion(GetTimeoutError("slow"), [piece]) is None


def test_a_poll_round_is_put_as_two_objects_and_only_what_will_be_trained_on():
    """The rollout host's `_keep_completions` on one poll round: the finished results to be trained on go into two
    objects (all ids, all log-probs), each completion referencing both with its slot, in order; a result whose
    request will not be trained on (`keep_output` False: validation, the API's generate), an aborted one and an empty
    round put nothing. Expected rows: `pack_completion` of each completion, the per-completion package of before."""
    from megarl.data.token_rows import round_row
    from megarl.rollout.engine_server import RequestResult
    from megarl.workers.rollout_host import _keep_completions

    store = Store()
    outs = _outputs(Store())  # 4 prompts x 2 completions (their refs from _outputs are replaced below)
    for o in outs:
        for c in o.completions:
            object.__delattr__(c, "token_ref")
    results = [RequestResult("a", "finished", outs[0]), RequestResult("v", "finished", outs[1], keep_output=False),
               RequestResult("x", "aborted"), RequestResult("b", "finished", outs[2])]
    _keep_completions(results, put=store.put)
    assert len(store.values) == 2  # one round: its ids and its log-probs, not two per completion
    kept = [(o, c) for o in (outs[0], outs[2]) for c in o.completions]
    for slot, (o, c) in enumerate(kept):
        ids_ref, log_probs_ref, got_slot, owner = token_ref(c)
        assert got_slot == slot and owner == -1  # no process group here: the rank is unknown
        ids, log_probs = pack_completion(o.prompt_ids, c.token_ids, c.log_probs)
        assert torch.equal(round_row(store.values[ids_ref], slot), ids)
        assert torch.equal(round_row(store.values[log_probs_ref], slot), log_probs)
    assert all(token_ref(c) is None for c in outs[1].completions + outs[3].completions)
    _keep_completions([RequestResult("v2", "finished", outs[3], keep_output=False)], put=store.put)
    assert len(store.values) == 2


def _multi_turn(trajectories):
    """The step's trajectories with an observation token inside every response of 3+ tokens (as a multi-turn
    episode's: loss mask 0, log-prob 0, context version) and no rollout references: rows the controller built."""
    out = []
    for t in trajectories:
        mask, log_probs, versions = list(t.loss_mask), list(t.log_probs), list(t.policy_version)
        if len(t) - t.prompt_len >= 3:
            gap = t.prompt_len + 1
            mask[gap], log_probs[gap], versions[gap] = 0, 0.0, -1
        out.append(Trajectory(t.token_ids, t.prompt_len, mask, log_probs, versions, t.uid, t.group_uid,
                              t.finish_reason))
    return out


@pytest.mark.parametrize("method", ["compute_log_probs", "compute_ref_log_probs", "update_actor"])
def test_rows_the_controller_built_are_put_once_per_piece_and_rebuilt_exactly(method):
    """Multi-turn episodes (`TokenRowSource.from_rows`): one object per piece, holding that piece's ids, log-probs and
    loss masks (gaps included), shared by every key; each rank rebuilds its share bit for bit as the by-value path
    sends it and fetches only its own pieces' objects."""
    trajectories = _multi_turn(_step(Store())[0])
    assert TokenRowSource.from_trajectories(trajectories, trajectories_to_batch(trajectories, PAD), PAD) is None
    batch = trajectories_to_batch(trajectories, pad_id=PAD)
    assert any(int((m[1:] - m[:-1]).abs().sum()) > 2 for m in batch["loss_mask"])  # a gap inside some response
    store = Store()
    source = TokenRowSource.from_rows(batch, PAD, put=store.put)
    got, calls = _shares(method, batch, source, store)
    want = _shares(method, batch, _NoSource(), Store())[0]  # the by-value path
    for share, by_value in zip(got, want):
        assert sorted(share.keys()) == sorted(by_value.keys())
        for key in share.keys():
            a, b = share[key], by_value[key]
            assert a.dtype == b.dtype and a.shape == b.shape, key
            same = torch.equal(a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 else \
                torch.equal(a, b)
            assert same, (method, key)
    packed = set(source.packed.values())
    for (args, _), fetched in zip(calls, store.gets):
        pieces = args[0].pieces
        mine = {r for k in TOKEN_KEYS if k in pieces for h in pieces[k] for r in h.refs}
        assert all(isinstance(h, TokenRowsPiece) and h.packed for k in TOKEN_KEYS if k in pieces for h in pieces[k])
        assert mine and mine == {r for r in fetched if r in packed}  # its own pieces' objects only, once each
        assert len(fetched) == len(set(fetched))
    assert len(packed) == len({(h.refs[0]) for args, _ in calls for h in args[0].pieces["input_ids"]})


def test_rows_not_in_the_batch_layout_are_not_packed():
    trajectories, batch = _step(Store())
    holes = batch.update({"attention_mask": batch["attention_mask"].flip(-1)})  # not a prefix of ones
    assert TokenRowSource.from_rows(holes, PAD) is None
    assert TokenRowSource.from_rows(Batch({k: v for k, v in batch.tensors.items() if k != "rollout_log_probs"}),
                                    PAD) is None
