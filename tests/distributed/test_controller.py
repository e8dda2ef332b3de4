"""The Ray single controller on CPU: a pool of 2 slots, one worker group of 2 gloo ranks, every dispatch mode with
hand-checked results, errors (worker exception, wall-bound timeout, a stopped rank, a killed rank, oversized /
unavailable pool), a long healthy call under a short heartbeat bound, and a real megatron-core engine at TP=2 driven
through dispatch methods. One Ray session for the module."""

from __future__ import annotations

import math
import os
import re
import signal
import time

import pytest
import ray  # a hard dependency (setup.py): a missing ray fails the import, never skips
import torch

from megarl.controller import (  # noqa: E402
    ALL_TO_ALL,
    DP_SPLIT,
    DP_SPLIT_MINI_BATCHES,
    LAST_STAGE_FIRST_RESULT,
    ONE_TO_ALL,
    RANK_ZERO,
    CallTimeout,
    DispatchError,
    ResourceError,
    ResourcePool,
    WorkerError,
    WorkerGroup,
    dispatch,
)

VOCAB = 256
SEQ = 16


class ProbeWorker:
    """Constructed on every rank after init_distributed(); each method is one dispatch case."""

    dp_group_size = 1  # default DP_SPLIT group size: every rank is its own replica

    def __init__(self, tag: str, scale: int = 1) -> None:
        import torch.distributed as dist

        self.tag, self.scale = tag, scale
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def model_group(self) -> int:  # DP_SPLIT group size given by a method
        return 2

    @dispatch(ONE_TO_ALL)
    def world_info(self):
        import torch.distributed as dist

        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        return {
            "rank": self.rank, "world": self.world, "local_rank": int(os.environ["LOCAL_RANK"]),
            "backend": dist.get_backend(), "sum": float(t.item()), "tag": self.tag, "scale": self.scale,
            "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]), "env": os.environ.get("MEGARL_TEST_ENV"),
            "pid": os.getpid(),
        }

    @dispatch(ONE_TO_ALL)
    def echo(self, x, y=0):
        return (self.rank, x, y)

    @dispatch(ALL_TO_ALL)
    def affine(self, x, b):
        return x * 10 + b + 100 * self.rank

    @dispatch(RANK_ZERO)
    def weighted_sum(self, v):
        import torch.distributed as dist

        t = torch.tensor([v * (self.rank + 1.0)])
        dist.all_reduce(t)  # needs every rank: RANK_ZERO still calls both
        return (self.rank, float(t.item()))

    @dispatch(LAST_STAGE_FIRST_RESULT)
    def last_stage(self, x):
        return None if self.rank == 0 else f"rank{self.rank}:{x}"

    @dispatch(DP_SPLIT)
    def tag_items(self, items, offset=0):
        return [(self.rank, i + offset) for i in items]

    @dispatch(DP_SPLIT, group_size_attr="model_group")
    def tag_items_grouped(self, items):
        # both ranks form one replica; only the "last stage" (rank 1) reports
        return [(self.rank, i) for i in items] if self.rank == 1 else None

    def reversed_replica(self) -> tuple[int, int]:  # (replica, n_replicas): rank 0 holds replica 1
        return (1 - self.rank, 2)

    @dispatch(DP_SPLIT, replica_attr="reversed_replica")
    def tag_items_reversed(self, items):
        return [(self.rank, i) for i in items]

    @dispatch(DP_SPLIT, group_size=1)
    def double(self, t):
        return t * 2 + self.rank

    mini_batch_samples = 4  # the share test's update: mini-batches of 4 rows, each cut over the 2 replicas

    @dispatch(DP_SPLIT, reads=("x",), optional_reads=("y",))
    def share_forward(self, batch):
        """What this rank received (a DP_SPLIT share with declared reads)."""
        return [(self.rank, sorted(batch.keys()), batch["x"].tolist(), batch.meta["dp_split_rows"])]

    @dispatch(DP_SPLIT_MINI_BATCHES, mini_batch_attr="mini_batch_samples", reads=("x",))
    def share_update(self, batch):
        """What each rank received (its share of every mini-batch), from every rank (an all-gather of the rows)."""
        import torch.distributed as dist

        got = [None] * self.world
        dist.all_gather_object(got, (self.rank, sorted(batch.keys()), batch["x"].tolist()))
        return got

    @dispatch(ONE_TO_ALL)
    def boom(self):
        if self.rank == 1:
            raise ValueError("boom on purpose")
        return "ok"

    @dispatch(ONE_TO_ALL, timeout_s=1.0)
    def slow(self):
        time.sleep(2.5)
        return "late"

    @dispatch(ONE_TO_ALL)
    def nap_then_sum(self, seconds: float):
        """Sleep `seconds`, then all_reduce rank+1 (a rank stopped during the nap holds its peer in the collective)."""
        import torch.distributed as dist

        time.sleep(seconds)
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        return (self.rank, float(t.item()))

    @dispatch(ONE_TO_ALL)
    def named_barriers(self, timeout_s: float):
        """Two `named_barrier`s: both ranks arrive at the first; rank 1 stays away from the second until rank 0 has
        given up on it (then arrives, so both processes keep counting the same barriers). Rank 0 returns the
        error message of the second; rank 1 returns None."""
        from torch.distributed.distributed_c10d import _get_default_store

        from megarl.platform.distributed import named_barrier

        named_barrier("both ranks", timeout_s=60)
        store = _get_default_store()
        if self.rank == 0:
            try:
                named_barrier("rank 1 to finish its part of the test", timeout_s=timeout_s)
            except TimeoutError as e:
                store.set("named_barrier_test/rank0_gave_up", "1")
                return str(e)
            store.set("named_barrier_test/rank0_gave_up", "1")
            return None
        import datetime

        # bounded: rank 0 gives up after timeout_s; 60 s more names this wait if it never does
        store.wait(["named_barrier_test/rank0_gave_up"], datetime.timedelta(seconds=timeout_s + 60))
        named_barrier("rank 1, late", timeout_s=60)
        return None

    @dispatch(ONE_TO_ALL)
    def worker_thread(self):
        import threading

        return threading.get_ident()

    def hidden(self):
        return "not exposed"

    @dispatch(ONE_TO_ALL)
    def megatron_tp2(self, steps: int):
        """Build a MegatronEngine at TP=2 over the group's world, train `steps` steps, return the mean losses."""
        from megarl.engine.megatron_engine import MegatronEngine, OptimizerSettings
        from megarl.models.spec import ModelSpec
        from megarl.parallel.groups import build_role_groups
        from megarl.parallel.topology import RoleTopology
        from tests.distributed.harness import next_token_ce_loss

        spec = ModelSpec(
            architecture="LlamaForCausalLM", num_layers=2, hidden_size=64, num_attention_heads=4,
            num_query_groups=2, head_dim=16, ffn_hidden_size=128, vocab_size=VOCAB, max_position_embeddings=64,
        )
        groups = build_role_groups(RoleTopology(tp=2))
        engine = MegatronEngine(spec, groups, optimizer=OptimizerSettings(lr=5e-3), seed=1234)
        loss_fn = next_token_ce_loss(engine)

        tokens = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(7))
        micro = [{"input_ids": tokens[:2]}, {"input_ids": tokens[2:]}]
        losses = []
        for _ in range(steps):
            out = engine.run(micro, loss_fn, forward_only=False)
            engine.step()
            losses.append(sum(float(m["loss_sum"]) for m in out) / sum(float(m["units"]) for m in out))
        return {"rank": self.rank, "tp_rank": groups.coord.tp, "losses": losses}


class FailingInit:
    def __init__(self) -> None:
        raise RuntimeError("cannot build this role")


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def group(ray_session):
    # half a CPU per slot: the group leaves one of the session's 2 CPUs free for the pool tests below
    pool = ResourcePool("probe_pool", nodes=1, devices_per_node=2, device="cpu", cpus_per_slot=0.5, timeout_s=30)
    g = WorkerGroup(pool, ProbeWorker, "hello", env={"MEGARL_TEST_ENV": "yes"}, call_timeout_s=120, scale=3)
    try:
        yield g
    finally:
        g.shutdown()


def test_workers_form_one_gloo_world(group):
    infos = group.world_info()
    assert [i["rank"] for i in infos] == [0, 1]
    assert [i["local_rank"] for i in infos] == [0, 1]
    assert all(i["world"] == 2 and i["backend"] == "gloo" for i in infos)
    assert [i["sum"] for i in infos] == [3.0, 3.0]  # all_reduce of rank+1
    assert all(i["tag"] == "hello" and i["scale"] == 3 and i["env"] == "yes" for i in infos)
    assert infos[0]["master"] == infos[1]["master"] == (group.master_addr, str(group.master_port))
    assert group.pids() == [i["pid"] for i in infos] and infos[0]["pid"] != infos[1]["pid"] != os.getpid()


def test_one_to_all_and_all_to_all(group):
    assert group.echo("x", y=5) == [(0, "x", 5), (1, "x", 5)]
    assert group.affine([1, 2], b=[3, 4]) == [1 * 10 + 3, 2 * 10 + 4 + 100]
    with pytest.raises(DispatchError, match=r"affine: ALL_TO_ALL needs every argument to have 2 elements.*has 3"):
        group.affine([1, 2, 3], b=[3, 4])


def test_rank_zero_and_last_stage(group):
    assert group.weighted_sum(2.0) == (0, 2.0 * 1 + 2.0 * 2)
    assert group.last_stage("z") == "rank1:z"


def test_dp_split_group_size_1_and_2(group):
    assert group.tag_items([10, 11, 12, 13], offset=1) == [(0, 11), (0, 12), (1, 13), (1, 14)]
    assert group.tag_items_grouped([10, 11, 12]) == [(1, 10), (1, 11), (1, 12)]  # one replica of 2 ranks
    # replicas from a per-rank (replica, n) attribute (the pp > 1 path): results still come back in replica order
    assert group.tag_items_reversed([10, 11, 12, 13]) == [(1, 10), (1, 11), (0, 12), (0, 13)]
    out = group.double(torch.arange(4.0))
    assert torch.equal(out, torch.tensor([0.0, 2.0, 5.0, 7.0]))
    # uneven chunks: rank 0 gets [1, 2], rank 1 gets [3] (the first chunks one larger), order kept
    assert group.tag_items([1, 2, 3]) == [(0, 1), (0, 2), (1, 3)]
    with pytest.raises(DispatchError, match=r"tag_items: DP_SPLIT cannot give each of 2 replicas at least one of 1"):
        group.tag_items([1])


def test_batch_shares_put_each_row_piece_once_and_ranks_get_only_their_share(group):
    """Inside `BatchShares` the forward's share (contiguous halves) and the update's (each mini-batch's half) are made
    of the same row pieces, each put once; a rank receives the rows and keys `plan_calls` would send (expected rows
    written out by hand: 8 rows, 2 replicas, mini-batches of 4)."""
    from megarl.controller.shares import BatchShares
    from megarl.data.batch import Batch

    batch = Batch({"x": torch.arange(8) * 10, "z": torch.ones(8)})  # z is read by neither method
    forward = [(0, ["x"], [0, 10, 20, 30], [0, 4]), (1, ["x"], [40, 50, 60, 70], [4, 8])]
    update = [(0, ["x"], [0, 10, 40, 50]), (1, ["x"], [20, 30, 60, 70])]
    assert group.share_forward(batch) == forward and group.share_update(batch) == update  # by value
    # every piece put (inline_bytes=0: x's 16-byte pieces would otherwise go with the calls, below)
    with BatchShares([(group, "share_forward"), (group, "share_update")], inline_bytes=0) as shares:
        assert group.share_forward(batch) == forward
        assert shares.puts == 4 and shares.keys_put == ["x"]  # rows cut at 0 2 4 6 8: the update's pieces too
        assert group.share_update(batch) == update
        assert group.share_forward(batch) == forward
        assert shares.puts == 4  # nothing put again
        batch.tensors["x"].add_(1)  # changed in place: its pieces are put again
        assert group.share_forward(batch)[0][2] == [1, 11, 21, 31] and shares.puts == 8
    # by default a small one-dimensional key's pieces go with the calls (InlinePiece): nothing put, the same rows;
    # a two-dimensional key of the same size is still put (token-sized data crosses once)
    batch = Batch({"x": torch.arange(8) * 10, "y": torch.zeros(8, 2)})
    with BatchShares([(group, "share_forward"), (group, "share_update")]) as shares:
        assert group.share_update(batch) == update and group.share_forward(batch) == [
            (0, ["x", "y"], [0, 10, 20, 30], [0, 4]), (1, ["x", "y"], [40, 50, 60, 70], [4, 8])]
        assert shares.inline_pieces == 4 and shares.inline_bytes_sent == 8 * 8
        assert shares.puts == 4 and shares.keys_put == ["y"]
    with pytest.raises(ValueError, match=r"no dispatch method 'nope'"):
        BatchShares([(group, "nope")])


def test_small_arguments_go_with_the_call_and_a_large_broadcast_is_put_once(group, monkeypatch):
    """A call's argument set goes with the call when it is small or one rank's own (no `ray.put`: Ray inlines it, or
    puts a large one itself); one `ray.put` is made for a large argument set that every rank receives. Counted on
    the controller's `ray.put` (observed, still called); the ranks' answers show each got the right value."""
    from megarl.controller import worker_group as wg

    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value) or real_put(value, **kw))
    assert group.echo("x", y=5) == [(0, "x", 5), (1, "x", 5)] and puts == []  # small broadcast: inline
    assert group.affine([1, 2], b=[3, 4]) == [13, 124] and puts == []  # per-rank values: inline
    big = torch.arange(wg.INLINE_ARGS_BYTES // 4 + 1, dtype=torch.float32)  # just over the bound
    out = group.echo(big)
    assert len(puts) == 1 and all(torch.equal(x, big) for _, x, _ in out)
    parts = group.double(torch.arange(2 * (wg.INLINE_ARGS_BYTES // 4 + 1), dtype=torch.float32))  # DP halves
    assert len(puts) == 1 and parts.shape[0] == 2 * (wg.INLINE_ARGS_BYTES // 4 + 1)  # each rank's own: no put
    assert wg.payload_bytes({"a": [big, (b"xy", "z")]}, 10**9) == big.numel() * 4 + 3
    assert wg.payload_bytes([big, big], 100) >= 100  # stops once the limit is reached


def test_undecorated_methods_are_not_exposed(group):
    assert "hidden" not in group.methods and "echo" in group.methods
    with pytest.raises(AttributeError, match=r"no controller method 'hidden'.*exposed: \[.*'echo'"):
        group.hidden()


def test_worker_exception_names_the_rank(group):
    with pytest.raises(WorkerError, match=r"ProbeWorker\.boom raised on rank 1 of 2") as info:
        group.boom()
    assert info.value.rank == 1
    assert "ValueError: boom on purpose" in str(info.value)  # the remote traceback
    assert group.echo(1) == [(0, 1, 0), (1, 1, 0)]  # the group still works


def test_timeout_names_the_method_and_ranks(group):
    t0 = time.monotonic()
    with pytest.raises(
        CallTimeout, match=r"ProbeWorker\.slow: rank\(s\) \[0, 1\] of 2 did not answer within 1s"
    ) as info:
        group.slow()
    assert info.value.ranks == [0, 1]
    assert time.monotonic() - t0 < 2.0


@pytest.fixture
def short_heartbeat(group):
    """The group with a 1.5 s heartbeat bound for one test (the attribute is read at each call)."""
    saved = group.heartbeat_timeout_s
    group.heartbeat_timeout_s = 1.5
    try:
        yield group
    finally:
        group.heartbeat_timeout_s = saved


def test_a_long_healthy_call_is_collected(short_heartbeat):
    """A call longer than the heartbeat bound (and than a wall bound of that size, the old rule) while its ranks are
    alive returns its result: the bound is on silence, not on the call's length."""
    group = short_heartbeat
    assert group.nap_then_sum(3.0) == [(0, 3.0), (1, 3.0)]  # twice the bound
    assert group.worker_thread() == group.worker_thread()  # the same worker thread every call (thread-local state)


def test_a_stopped_rank_is_named(short_heartbeat):
    """SIGSTOP rank 1 during its nap: rank 0 waits for it in the all_reduce (alive, answering heartbeats); the call
    fails naming rank 1, its pid and the call; after SIGCONT the call completes and the group works again."""
    group = short_heartbeat
    pids = group.pids()
    call = group.nap_then_sum.submit(1.0)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        with pytest.raises(CallTimeout) as info:
            call.result()
    finally:
        os.kill(pids[1], signal.SIGCONT)
    message = str(info.value)
    assert info.value.ranks == [1], message
    assert "ProbeWorker.nap_then_sum: rank(s) [1] of 2 stopped answering their heartbeat" in message
    assert f"rank 1 pid {pids[1]}" in message and "Still running and alive: [0]" in message
    assert call.result() == [(0, 3.0), (1, 3.0)]  # resumed: the same call now finishes and is collected


def test_named_barrier_names_what_it_waited_for_and_the_missing_rank(group):
    """`megarl.platform.distributed.named_barrier` (the checkpoint commit barriers) on the group's gloo world."""
    rank0, rank1 = group.named_barriers(1.0)
    assert rank1 is None
    assert re.fullmatch(r"rank 0: waited 1 s for rank 1 to finish its part of the test: rank\(s\) \[1\] of 2 did not "
                        r"arrive \(barrier megarl/barrier/\d+\)", rank0), rank0
    assert group.echo(1) == [(0, 1, 0), (1, 1, 0)]


def test_megatron_engine_tp2_through_the_controller(group):
    results = group.megatron_tp2(2)
    assert [r["tp_rank"] for r in results] == [0, 1]
    losses = [r["losses"] for r in results]
    assert losses[0] == losses[1], f"TP ranks disagree: {losses}"
    assert all(math.isfinite(x) for x in losses[0])
    assert abs(losses[0][0] - math.log(VOCAB)) < 0.5  # random init ~ ln(vocab)
    assert losses[0][1] < losses[0][0]


def test_oversized_pool_fails_fast(ray_session):
    t0 = time.monotonic()
    with pytest.raises(
        ResourceError, match=r"pool 'too_big' needs 1 node\(s\) x 5 slot\(s\) of \{'CPU': 0.5\} = 5 cpu"
    ) as info:
        ResourcePool("too_big", nodes=1, devices_per_node=5, cpus_per_slot=0.5)
    assert "{'CPU': 2.5}" in str(info.value) and "only 0 of the cluster's 1 node(s)" in str(info.value)
    assert time.monotonic() - t0 < 5.0


def test_busy_cluster_times_out_with_the_numbers(group):
    # the group holds 1 of the 2 CPUs: a 1.5-CPU slot fits the node but cannot be granted now; ready() gives up
    pool = ResourcePool("late_pool", nodes=1, devices_per_node=1, cpus_per_slot=1.5)
    with pytest.raises(
        ResourceError, match=r"pool 'late_pool': 1 of 1 node reservation\(s\) \(nodes \[0\]\) not granted within 1.\ds"
    ):
        pool.ready(timeout_s=1.0)


def test_submit_overlaps_and_collects(group):
    first, second = group.echo.submit(7), group.weighted_sum.submit(1.0)
    assert second.result() == (0, 3.0)
    assert first.done() and first.result() == [(0, 7, 0), (1, 7, 0)]


def test_constructor_failure_names_the_rank_and_cleans_up(group):
    pool = ResourcePool("fail_pool", nodes=1, devices_per_node=1, cpus_per_slot=0.5)
    try:
        with pytest.raises(WorkerError, match=r"FailingInit\.__init__ raised on rank 0 of 1") as info:
            WorkerGroup(pool, FailingInit, init_timeout_s=60)
        assert "RuntimeError: cannot build this role" in str(info.value)
    finally:
        pool.shutdown()


def test_a_killed_rank_is_named(short_heartbeat):
    """SIGKILL rank 1 during a call: the call fails naming rank 1 as dead (rank 0 is left in the all_reduce; the
    next test shuts the group down)."""
    group = short_heartbeat
    pids = group.pids()
    call = group.nap_then_sum.submit(30.0)
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"ProbeWorker\.nap_then_sum: the actor of rank 1 of 2 died") as info:
        call.result()
    assert info.value.rank == 1


def test_shutdown_kills_actors_and_frees_the_pool(group):
    """Last in the module: the fixture's own shutdown afterwards is a no-op."""
    actors = group.actors
    group.shutdown()
    group.shutdown()  # idempotent
    assert group.world_size == 0 and group.pool.placement_groups == []
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actors[0].attr.remote("rank"), timeout=30)
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2  # every pool of the module is gone
