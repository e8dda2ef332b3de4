"""Bytes each rank deserialises per RL step from the controller's calls: the old full broadcast (ONE_TO_ALL /
LAST_STAGE_FIRST_RESULT / RANK_ZERO: every rank receives the whole prompt list and the whole batch) against the DP
split (DP_SPLIT, and DP_SPLIT_MINI_BATCHES for the update: a rank receives only its replica's part). Pure: no Ray, no
processes.

    python benchmarks/dispatch_bytes.py [--json FILE]

What each rank would receive is computed by the controller's own `plan_calls` (the same function `WorkerGroup` uses)
for both specs and measured as `len(pickle.dumps(call))` -- what Ray serialises per distinct argument set (tensors
travel as pickle-5 buffers of the same size). Layouts (rank order as megatron's tp-cp-ep-dp-pp, as
`megarl.parallel.topology`): actor/reference replica of rank r = (r // tp) % dp; rollout replica = r // rollout_tp.
Calls of one GRPO step as `RLLoop.step` makes them: generate(prompts, sampling), compute_log_probs(batch),
compute_ref_log_probs(batch + scores + old_log_probs), update_actor(that + ref_log_probs + advantages + returns):
RANK_ZERO before (the whole batch to every rank, each cutting its part of every mini-batch), DP_SPLIT_MINI_BATCHES
after (a replica receives its part of every mini-batch of `mini_batch_prompts * samples_per_prompt` samples, plus
its layout in `meta`; `megarl.data.mini_batches`). update_critic is cut the same way (not in these GRPO layouts).
Before, `generate` also broadcast the
replica's prompts again inside its TP group (`rollout/vllm_adapter.py`: the non-first TP ranks deserialised the
chunk a second time); that is counted in generate's "before" and replaced by an 8-byte digest all-gather (a tensor,
nothing deserialised). Also reported: the result bytes the old path all-gathered over DP on every last-stage rank.
The `generate` row is the batch worker call as it was when measured; it was deleted with issue 31 (every rollout is
now requests to the replicas' servers, `megarl.controller.serving`), so that row is history, not today's path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megarl.controller.dispatch import (  # noqa: E402
    DP_MODES,
    DP_SPLIT,
    DP_SPLIT_MINI_BATCHES,
    LAST_STAGE_FIRST_RESULT,
    ONE_TO_ALL,
    RANK_ZERO,
    DispatchSpec,
    dispatched_methods,
    plan_calls,
)
from megarl.data.batch import Batch  # noqa: E402
from megarl.rollout.engine import SamplingSettings  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    pp: int
    dp: int
    rollout_tp: int
    prompts: int
    samples_per_prompt: int
    prompt_tokens: int
    seq_len: int
    mini_batch_prompts: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


LAYOUTS = [
    Layout("64-rank simulated: actor/ref TP8 PP2 DP4, rollout TP8; 256 prompts x 8 samples x 1024 tokens, "
           "mini-batches of 64 prompts",
           tp=8, pp=2, dp=4, rollout_tp=8, prompts=256, samples_per_prompt=8, prompt_tokens=256, seq_len=1024,
           mini_batch_prompts=64),
    Layout("2-rank quickstart (yaml_configs/cpu_quickstart.yaml): actor/ref TP2 DP1, rollout TP2; 8 prompts x 4 "
           "samples, mini-batches of 4 prompts, prompts <= 64 tokens, sequences <= 64 + 32 tokens (its shape limits)",
           tp=2, pp=1, dp=1, rollout_tp=2, prompts=8, samples_per_prompt=4, prompt_tokens=64, seq_len=96,
           mini_batch_prompts=4),
]


def step_inputs(lay: Layout):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 500, (lay.prompts, lay.prompt_tokens), generator=g).tolist()
    B, S = lay.prompts * lay.samples_per_prompt, lay.seq_len
    batch = Batch({  # the tensors samples_to_batch makes (int64 ids/masks, fp32 log-probs)
        "input_ids": torch.randint(3, 500, (B, S), generator=g), "attention_mask": torch.ones(B, S, dtype=torch.long),
        "response_mask": torch.ones(B, S, dtype=torch.long), "rollout_log_probs": torch.rand(B, S, generator=g),
        "group_ids": torch.arange(B) // lay.samples_per_prompt,
    })
    ref_batch = Batch({**batch.tensors, "scores": torch.rand(B, generator=g), "old_log_probs": torch.rand(B, S)})
    update_batch = ref_batch.update({k: torch.rand(B, S, generator=g)
                                     for k in ("ref_log_probs", "advantages", "returns")})
    return prompts, SamplingSettings(samples_per_prompt=lay.samples_per_prompt), batch, ref_batch, update_batch


def per_rank_bytes(spec: DispatchSpec, args: tuple, world: int, replica_of, mini_batch_samples=None) -> list[int]:
    calls = plan_calls(spec, args, {}, world, replica_of if spec.mode in DP_MODES else None,
                       mini_batch_samples=mini_batch_samples)
    sizes: dict[int, int] = {}
    return [sizes.setdefault(id(c), len(pickle.dumps(c, protocol=5))) for c in calls]


def measure(lay: Layout) -> dict:
    prompts, sampling, batch, ref_batch, update_batch = step_inputs(lay)
    ranks = range(lay.world)
    role_replica = [(r // lay.tp) % lay.dp for r in ranks]
    rollout_replica = [r // lay.rollout_tp for r in ranks]
    split = DispatchSpec(DP_SPLIT)
    cut = DispatchSpec(DP_SPLIT_MINI_BATCHES, mini_batch_attr="actor_mini_batch_samples")
    calls = [  # (method, old spec, new spec, args, replicas)
        ("generate", ONE_TO_ALL, split, (prompts, sampling), rollout_replica),
        ("compute_log_probs", LAST_STAGE_FIRST_RESULT, split, (batch,), role_replica),
        ("compute_ref_log_probs", LAST_STAGE_FIRST_RESULT, split, (ref_batch,), role_replica),
        ("update_actor", RANK_ZERO, cut, (update_batch,), role_replica),
    ]
    mini = lay.mini_batch_prompts * lay.samples_per_prompt
    rows, before, after = [], [0] * lay.world, [0] * lay.world
    chunk = prompts[: -(-lay.prompts // (lay.world // lay.rollout_tp))]
    tp_bcast = len(pickle.dumps([chunk, sampling])) if lay.rollout_tp > 1 else 0
    for name, old_mode, new_spec, args, replica_of in calls:
        b = per_rank_bytes(DispatchSpec(old_mode), args, lay.world, replica_of)
        if name == "generate":  # the old second broadcast inside the TP replica, received by its non-first ranks
            b = [x + (tp_bcast if r % lay.rollout_tp else 0) for r, x in zip(ranks, b)]
        a = per_rank_bytes(new_spec, args, lay.world, replica_of, mini)
        before = [x + y for x, y in zip(before, b)]
        after = [x + y for x, y in zip(after, a)]
        rows.append({"call": name, "before_max_rank_bytes": max(b), "after_max_rank_bytes": max(a),
                     "before_total_bytes": sum(b), "after_total_bytes": sum(a)})
    B, S = len(batch), lay.seq_len
    # old: every last-stage rank all-gathered the other DP ranks' results: log_probs + entropy, then log_probs (fp32)
    gathered = (lay.dp - 1) * (B // lay.dp) * S * 4 * (2 + 1) if lay.dp > 1 else 0
    return {
        "layout": lay.name, "world_size": lay.world, "samples": B, "seq_len": S, "mini_batch_samples": mini,
        "calls": rows,
        "step_before_max_rank_bytes": max(before), "step_after_max_rank_bytes": max(after),
        "step_before_total_bytes": sum(before), "step_after_total_bytes": sum(after),
        "old_dp_allgather_bytes_per_last_stage_rank": gathered,
        "old_in_engine_tp_broadcast_bytes_per_non_first_tp_rank": tp_bcast,
    }


# -- issue 30: declared reads and results kept on the ranks ---------------------------------------------------------


def byref_step(lay: Layout, critic: bool, mode: str) -> dict:
    """Bytes through the controller and deserialised per rank in one step (GRPO + reference with KL in the loss, or
    with `critic` PPO + reference + critic on the actor's ranks), as `RLLoop.step` makes the calls.

    `mode`: "before" = main before issue 30 (every call ships the whole batch, every result comes up and goes down);
    "reads" = the role methods' declared reads (`RoleHost`'s `@dispatch(reads=...)`) and the results kept on the ranks
    (`WorkerGroup.results_stay`; the old log-probs fetched for the mismatch metrics, the values for the advantages),
    each call's shares sent by value; "once" = that, with the step's batch put once (`BatchShares`: each call's
    shares are references to row pieces cut at every call's share boundaries, each piece put once per step);
    "ranks" = that, with the mismatch metrics computed on the actor's ranks (the old log-prob forward reads vLLM's
    log-probs and returns [B] mismatch rows, `mismatch_rows`; the old log-probs come up only when they are not kept)
    and the update sent vLLM's log-probs only where it reads them (`update_reads_rollout_log_probs`: not here);
    "seq" = that, with a score-based estimator's advantages (GRPO here; not GAE) sent as [B] per-sequence values
    (`sequence_advantages`, `megarl.algorithms.advantages.per_sequence_advantages`) and expanded over the loss mask
    on the ranks (`update_actor(per_sequence=...)`); "tokens" = that, with input_ids, attention_mask, loss_mask and
    rollout_log_probs built on the ranks from the rollout's poll-round packages (`megarl.data.token_rows`: each
    call's share carries, per row, its lengths, a check, the ref of the round object the key is built from and its
    slot in it; the rank fetches, once per call, the ids objects ([P + R] int64 per row) of the rounds its rows are
    in where it reads input_ids and their log-probs objects ([R] float32 per row) where it reads rollout_log_probs,
    counted as one round per rollout replica per step, other DP shares' rows included; the masks are built from the
    lengths); "gae" = that, with GAE on the critic's ranks where its results stay (`RoleHost.compute_values(gae=)`:
    the critic's forward reads the scores [B] of its share; values, returns and advantages are kept on its ranks for
    both updates, nothing token-sized comes up or goes down for them); "peers" = that, with the results kept also
    where the update is cut differently over the same DP ranks (several mini-batches: `WorkerGroup.results_exchange`),
    the ranks exchanging the rows of their update shares among their DP peers (`RoleHost._with_kept(exchange=True)`,
    `megarl.workers.kept_rows`; those bytes, worker to worker, reported as dp_peer_exchange_max_rank_bytes).
    Down: by value, each distinct per-replica argument set once through the controller (`ray.put`), its size on every
    rank that receives it; by reference, each piece once through the controller, and a rank deserialises the pieces
    of its share plus its call (an object ref counted as its 28-byte id). Up: the results, one per replica.
    Generation's output is counted as its [B, S] token ids and log-probs (the samples' payload), the same in every
    mode."""
    from megarl.algorithms.rollout_correction import mismatch_rows
    from megarl.controller.dispatch import chunk_bounds, plan_shared_calls, share_rows, shares_cover, shares_exchange
    from megarl.data.mini_batches import share_layout
    from megarl.data.token_rows import TOKEN_KEYS, TokenRowsPiece, pack_completion, pack_round, row_checks
    from megarl.workers.role_host import FORWARD_OPTIONAL, MASKS, RoleHost

    specs = dispatched_methods(RoleHost)
    if mode not in GAE_MODES:  # before GAE moved to the critic's ranks: its forward read no scores
        specs["compute_values"] = dataclasses.replace(specs["compute_values"], optional_reads=MASKS)
    if mode in ("reads", "once"):  # before the mismatch moved to the ranks: the forward read no log-probs
        specs["compute_log_probs"] = dataclasses.replace(specs["compute_log_probs"], optional_reads=FORWARD_OPTIONAL)
    _, _, batch, _, _ = step_inputs(lay)
    B, S = len(batch), lay.seq_len
    g = torch.Generator().manual_seed(1)
    f = lambda: torch.rand(B, S, generator=g)  # noqa: E731
    batch = Batch({k: v for k, v in batch.tensors.items() if k != "response_mask"}
                  | {"loss_mask": batch["response_mask"], "policy_version": torch.zeros(B, S, dtype=torch.long),
                     "scores": torch.rand(B, generator=g)})
    ranks = range(lay.world)
    replica = [(r // lay.tp) % lay.dp for r in ranks]
    last_stage = [r >= lay.world - lay.world // lay.pp for r in ranks]
    mini = lay.mini_batch_prompts * lay.samples_per_prompt
    covered = shares_cover(replica, replica, B, mini)
    # several mini-batches over several DP ranks: the ranks exchange their kept rows among their DP peers
    exchanged = mode in EXCHANGE_MODES and not covered and shares_exchange(replica, replica, B, mini)
    stay = mode != "before" and (covered or exchanged)
    rows, per_rank = [], [0] * lay.world
    through = 0
    step_calls = ["compute_log_probs", "compute_ref_log_probs"] + (["compute_values", "update_critic"] if critic
                                                                     else []) + ["update_actor"]
    cuts = sorted({x for name in step_calls for ranges, _ in share_rows(
        specs[name], B, lay.dp, mini if specs[name].mode is DP_SPLIT_MINI_BATCHES else None)
        for lo, hi in ranges for x in (lo, hi)})
    put: dict[tuple, tuple[bytes, int]] = {}  # (key, tensor id, lo, hi) -> (handle, pickled bytes): one put each

    source = {k: batch[k] for k in TOKEN_KEYS} if mode in TOKEN_MODES else {}  # the rollout's packages' keys
    lengths = [S] * B  # each row: prompt_tokens of prompt, the rest sampled (the layouts' shape limits)
    # The rollout host puts one poll round's completions as two objects (`pack_round`: all their ids, all their
    # log-probs). Counted here: one round per rollout replica per step, its B / replicas consecutive rows -- the
    # fewest puts and the most rows of other DP shares a rank deserialises with its own (smaller rounds: fewer).
    rows_per_round = max(1, B // (lay.world // lay.rollout_tp))
    ids, lps = pack_completion(list(range(lay.prompt_tokens)), list(range(S - lay.prompt_tokens)),
                               [0.5] * (S - lay.prompt_tokens))
    package = [len(pickle.dumps(pack_round([ids] * rows_per_round), protocol=5)),
               len(pickle.dumps(pack_round([lps] * rows_per_round), protocol=5))]  # a round's two objects

    def piece(key, tensor, lo, hi):
        if source.get(key) is tensor:  # by reference: nothing put; the handle travels inside the call
            which = {"input_ids": 0, "rollout_log_probs": 1}.get(key)  # the masks: from the lengths alone
            rows = [] if which is None else range(lo, hi)
            refs = [(2 * (i // rows_per_round) + which).to_bytes(28, "little") for i in rows]  # its round's object
            owners = [i // rows_per_round * lay.rollout_tp for i in rows]  # each row's rollout rank (replicas in order)
            return TokenRowsPiece(key, refs, [lay.prompt_tokens] * (hi - lo), lengths[lo:hi],
                                  row_checks(tensor[lo:hi]), S, 0, owners,
                                  [i % rows_per_round for i in rows])  # an object ref counted as its 28-byte id
        index = (key, id(tensor), lo, hi)
        if index not in put:
            put[index] = (len(put).to_bytes(28, "little"), len(pickle.dumps(tensor[lo:hi].clone(), protocol=5)))
        return put[index][0]

    size_of = {}  # handle -> pickled bytes of its piece

    def down(name, data, kwargs=None):
        nonlocal through
        spec = specs[name] if mode != "before" else dataclasses.replace(specs[name], reads=None, optional_reads=())
        m = mini if spec.mode is DP_SPLIT_MINI_BATCHES else None
        known = set(put)
        if mode in BY_REFERENCE_MODES:
            calls = plan_shared_calls(spec, (data,), kwargs or {}, lay.world, replica, piece, cuts, name,
                                      mini_batch_samples=m)
            size_of.update(put.values())
        else:
            calls = plan_calls(spec, (data,), kwargs or {}, lay.world, replica, name, mini_batch_samples=m)
        sizes: dict[int, int] = {}
        got = []
        for c in calls:
            n = sizes.setdefault(id(c), len(pickle.dumps(c, protocol=5)))
            if mode in BY_REFERENCE_MODES:
                handles = [h for hs in c[0][0].pieces.values() for h in hs]
                n += sum(size_of[h] for h in handles if not isinstance(h, TokenRowsPiece))
                # by reference: the rank fetches each round object its rows are in once, for all the keys reading it
                n += sum(package[int.from_bytes(r, "little") % 2]
                         for r in {r for h in handles if isinstance(h, TokenRowsPiece) for r in h.refs})
            got.append(n)
        new_pieces = {k: v for k, v in put.items() if k not in known}
        through += sum(sizes.values()) + sum(b for _, b in new_pieces.values())
        for r, x in enumerate(got):
            per_rank[r] += x
        share = calls[0][0][0]
        by_ref = mode in BY_REFERENCE_MODES
        keys = sorted(share.pieces if by_ref else share.keys())
        sent = sorted({k for k, *_ in new_pieces}) if by_ref else keys  # what crossed in this call
        rows.append({"call": name, "dir": "down", "keys": keys, "keys_crossing": sent,
                     "bytes": sum(sizes.values()) + sum(b for _, b in new_pieces.values()), "max_rank": max(got)})

    def up(name, tensors: dict):
        nonlocal through
        n = len(pickle.dumps(Batch(tensors), protocol=5)) if tensors else 0
        through += n
        rows.append({"call": name, "dir": "up", "keys": sorted(tensors), "keys_crossing": sorted(tensors),
                     "bytes": n, "max_rank": 0})

    up("generate", {"input_ids": batch["input_ids"], "rollout_log_probs": batch["rollout_log_probs"]})
    down("compute_log_probs", Batch({k: v for k, v in batch.tensors.items() if k != "policy_version"})
         if mode in RANKS_MODES else batch)  # one weights version: RLLoop leaves the versions out
    old = f()
    if mode in RANKS_MODES:
        rows_up = mismatch_rows(old, batch["rollout_log_probs"], batch["loss_mask"])
        up("compute_log_probs", rows_up if stay else {"log_probs": old, **rows_up})
    else:
        up("compute_log_probs", {"log_probs": old} if mode != "before" else {"log_probs": old, "entropy": f()})
    batch = batch.update({"old_log_probs": old})
    down("compute_ref_log_probs", batch)
    ref = f()
    if not stay:
        up("compute_ref_log_probs", {"log_probs": ref})
        batch = batch.update({"ref_log_probs": ref})
    gae_here = critic and stay and mode in GAE_MODES  # GAE on the critic's ranks: nothing comes up or goes down
    if critic:
        # GAE elsewhere: RLLoop leaves the scores out of the critic's forward
        down("compute_values", batch if gae_here or mode not in GAE_MODES else Batch(
            {k: v for k, v in batch.tensors.items() if k != "scores"}))
        values = f()
        if not gae_here:
            up("compute_values", {"values": values})
        batch = batch.update({"old_values": values})
    if mode in SEQ_MODES and not critic:  # GRPO: one number per sequence, [B] down, expanded on the ranks
        batch = batch.update({"sequence_advantages": torch.rand(B, generator=g), "returns": f()})
    else:
        batch = batch.update({"advantages": f(), "returns": f()})
    kept = {"old_log_probs", "ref_log_probs", "old_values"} if stay else set()
    if gae_here:
        kept |= {"advantages", "returns"}
    trimmed = Batch({k: v for k, v in batch.tensors.items() if k not in kept})
    if critic:
        down("update_critic", trimmed)
    if mode in RANKS_MODES:  # no rollout correction, a separate old-log-prob forward: no vLLM log-probs
        trimmed = Batch({k: v for k, v in trimmed.tensors.items() if k != "rollout_log_probs"})
    down("update_actor", trimmed)
    # worker to worker (not through the controller): the rows of a rank's update share its DP peers kept, per key
    # read from the kept store (float32 [rows, S])
    peer_bytes = 0
    if exchanged:
        reads_kept = {"update_actor": {"old_log_probs", "ref_log_probs"} | ({"advantages"} if critic else set()),
                      "update_critic": {"old_values", "returns"} if critic else set()}
        keys = sum(len(v) for v in reads_kept.values())
        far = max(sum(b - a - max(0, min(b, hi) - max(a, lo)) for a, b in share_layout(B, mini, lay.dp, k).rows)
                  for k in range(lay.dp) for lo, hi in [chunk_bounds(B, lay.dp, k)])
        peer_bytes = keys * far * S * 4
    # GAE on the critic's ranks with several DP ranks: each last-stage critic rank all-gathers the other shares'
    # unwhitened advantages (float32) and masks (bool) for the whitening's statistics, worker to worker
    gae_gather_bytes = (B - min(hi - lo for lo, hi in [chunk_bounds(B, lay.dp, k) for k in range(lay.dp)])) * S * 5 \
        if gae_here and lay.dp > 1 else 0
    token_sized = {"input_ids", "attention_mask", "loss_mask", "rollout_log_probs", "policy_version", "log_probs",
                   "entropy", "old_log_probs", "ref_log_probs", "values", "old_values", "advantages", "returns"}
    crossings = sum(1 for r in rows for k in r["keys_crossing"] if k in token_sized)
    return {"calls": rows, "through_controller_bytes": through, "max_rank_bytes": max(per_rank),
            "last_stage_max_rank_bytes": max(x for x, last in zip(per_rank, last_stage) if last),
            "token_sized_key_crossings": crossings, "results_stay": stay, "dp_peer_exchange": exchanged,
            "dp_peer_exchange_max_rank_bytes": peer_bytes, "gae_allgather_max_rank_bytes": gae_gather_bytes,
            "pieces_per_key": len(cuts) - 1 if mode in BY_REFERENCE_MODES else None}


MODES = ("before", "reads", "once", "ranks", "seq", "tokens", "gae", "peers")
BY_REFERENCE_MODES = MODES[2:]
RANKS_MODES = MODES[3:]
SEQ_MODES = MODES[4:]
TOKEN_MODES = MODES[5:]
GAE_MODES = MODES[6:]
EXCHANGE_MODES = MODES[7:]


def byref_table(lay: Layout) -> list[dict]:
    out = []
    for critic in (False, True):
        out.append({"layout": lay.name, "algorithm": "PPO + critic + reference" if critic else "GRPO + reference",
                    **{m: byref_step(lay, critic, m) for m in MODES}})
    return out


def mib(x: int) -> str:
    return f"{x / 2**20:.3f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from megarl.platform.host import host_cpu

    out = {"host_cpu": host_cpu(),
           "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
                       "python": platform.python_version(), "torch": torch.__version__},
           "results": [measure(lay) for lay in LAYOUTS],
           "byref": [row for lay in LAYOUTS for row in byref_table(lay)]}
    for r in out["results"]:
        print(r["layout"])
        for c in r["calls"]:
            print(f"  {c['call']:24s} per rank (max) {mib(c['before_max_rank_bytes'])} -> "
                  f"{mib(c['after_max_rank_bytes'])}   all ranks {mib(c['before_total_bytes'])} -> "
                  f"{mib(c['after_total_bytes'])}")
        print(f"  step (4 calls)           per rank (max) {mib(r['step_before_max_rank_bytes'])} -> "
              f"{mib(r['step_after_max_rank_bytes'])}   all ranks {mib(r['step_before_total_bytes'])} -> "
              f"{mib(r['step_after_total_bytes'])}")
        print(f"  removed: in-engine TP broadcast "
              f"{mib(r['old_in_engine_tp_broadcast_bytes_per_non_first_tp_rank'])} per non-first TP rank (in "
              f"generate's before), DP all-gather "
              f"{mib(r['old_dp_allgather_bytes_per_last_stage_rank'])} per last-stage rank")
    print("\nissue 30: one step, " + " -> ".join(MODES) + " (before: main before issue 30; reads: declared reads + "
          "results kept on the ranks; once: + the batch put once; ranks: + the mismatch metrics on the ranks, "
          "rollout_log_probs only to the calls that read them; seq: + score-based advantages down as [B] values, "
          "expanded over the loss mask on the ranks; tokens: + the token keys built on the ranks from the rollout's "
          "poll-round packages; gae: + GAE on the critic's ranks, values, advantages and returns kept there; peers: + "
          "results kept where the update is cut differently, rows exchanged among DP peers)")
    for r in out["byref"]:
        last = r[MODES[-1]]
        print(f"{r['layout'][:40]}... {r['algorithm']}: through the controller "
              + " -> ".join(mib(r[m]['through_controller_bytes']) for m in MODES) + "; per rank (max) "
              + " -> ".join(mib(r[m]['max_rank_bytes']) for m in MODES) + "; token-sized tensor crossings "
              + " -> ".join(str(r[m]['token_sized_key_crossings']) for m in MODES)
              + f" (results stay: {last['results_stay']}; pieces per key {last['pieces_per_key']}; DP peer exchange "
              f"{mib(last['dp_peer_exchange_max_rank_bytes'])} per rank (max); GAE's all-gather "
              f"{mib(last['gae_allgather_max_rank_bytes'])} per critic rank (max))")
        for c in last["calls"]:
            print(f"    {MODES[-1]} {c['call']:22s} {c['dir']:4s} {mib(c['bytes']):>12s}  crossing: "
                  f"{', '.join(c['keys_crossing']) or '-'}  (reads {', '.join(c['keys'])})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
