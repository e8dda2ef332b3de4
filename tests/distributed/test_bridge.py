"""The bridge between two pools (`megarl.controller.bridge`) on 3 gloo processes, each already in a default world of
its own kind (as a worker of a pool is): a standalone gloo group built from a TCPStore on bridge rank 0, and the
reshard's `GroupTransport` over it.

- messages reach the right peer with the right contents, matched by tag, in both directions at once;
- a receive whose peer never sends fails within the bridge's timeout, naming the bridge, the peer and this rank;
- a peer outside the bridge is refused before anything is posted.
"""

from __future__ import annotations

import socket

import pytest
import torch

from megarl.platform.spawn import run_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port):
    import time

    from megarl.controller.bridge import BridgeSpec, connect_bridge
    from megarl.reshard.transport import Message

    # 1 "train" rank + 2 "rollout" ranks; short timeout for the hang case
    spec = BridgeSpec("127.0.0.1", port, train_ranks=1, rollout_ranks=2, timeout_s=4.0, name="test-bridge")
    me = spec.rank("train", 0) if rank == 0 else spec.rank("rollout", rank - 1)
    bridge = connect_bridge(spec, me)
    t = bridge.transport
    out = {"rank": bridge.rank}
    # rank 0 sends k*10 + (0..3) to rank k on tag 2 and a marker on tag 0; ranks 1, 2 send their rank back on tag 1
    if me == 0:
        sends = [Message(k, torch.arange(4, dtype=torch.float32) + 10 * k, tag=2) for k in (1, 2)]
        sends += [Message(k, torch.full((1,), -float(k)), tag=0) for k in (1, 2)]
        back = [Message(k, torch.zeros(1), tag=1) for k in (1, 2)]
        t.post(sends, back).wait()
        out["back"] = [float(m.tensor[0]) for m in back]
    else:
        marker, payload = torch.zeros(1), torch.zeros(4)
        # posted in the other order than sent: tags keep them apart
        t.post([Message(0, torch.full((1,), float(me)), tag=1)],
               [Message(0, payload, tag=2), Message(0, marker, tag=0)]).wait()
        out["payload"], out["marker"] = payload.tolist(), float(marker[0])
    # the hang: rollout rank 2 waits for a message rank 0 never sends
    if me == 2:
        start = time.monotonic()
        try:
            t.post([], [Message(0, torch.zeros(1), tag=7)]).wait()
            out["hang_error"] = None
        except RuntimeError as e:
            out["hang_error"], out["hang_s"] = str(e), time.monotonic() - start
    try:
        t.post([Message(5, torch.zeros(1))], [])
        out["peer_error"] = None
    except ValueError as e:
        out["peer_error"] = str(e)
    time.sleep(6.0 if me != 2 else 0.0)  # stay connected while rank 2 times out
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(3, _worker, _free_port(), timeout_s=180)


def test_messages_reach_their_peer_by_tag(runs):
    assert [r["rank"] for r in runs] == [0, 1, 2]
    assert runs[0]["back"] == [1.0, 2.0]
    for k in (1, 2):
        assert runs[k]["payload"] == [10.0 * k + i for i in range(4)]
        assert runs[k]["marker"] == -float(k)


def test_a_missing_peer_times_out_naming_the_bridge_and_the_peer(runs):
    err = runs[2]["hang_error"]
    assert err is not None and runs[2]["hang_s"] < 30.0
    assert "bridge 'test-bridge'" in err and "receive from bridge rank 0" in err and "on bridge rank 2" in err, err


def test_a_peer_outside_the_bridge_is_refused(runs):
    for r in runs:
        assert "peer 5 is not another of its 3 ranks" in r["peer_error"]
