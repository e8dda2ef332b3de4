"""`RoleHost`: the Megatron roles of one rank and their controller-callable methods, written once; `RoleWorker`: a
role on a pool of its own.

A host is one rank of a pool's torch.distributed world (its ranks start at 0). It builds the roles it is given from
the job config at their configured layouts (`megarl.roles.factory.build_role`, HF weights loaded directly), keeps an
`OffloadPolicy` per role and exposes the role methods the trainer calls: `compute_log_probs` (actor),
`compute_ref_log_probs` (reference), `compute_values` (critic), `score` (reward model) -- each DP_SPLIT over its
role's data-parallel ranks -- `update_actor`, `update_critic` -- each DP_SPLIT_MINI_BATCHES: a DP rank receives its
part of every mini-batch -- and the checkpoint calls. The same method names on
every group (a `HybridWorker` hosting the actor and the roles colocated with it, a `RoleWorker` hosting a critic,
reference or reward model on its own pool), so the trainer addresses a role the same way wherever it is placed; a
method whose role this host does not hold raises naming the roles it does.

Every method is SPMD: the controller calls it on every rank of the group (`megarl.controller` dispatch), because the
roles' collectives need all ranks.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.config.schema import JobConfig
from megarl.controller.dispatch import SPLIT_ROWS_META, Dispatch, dispatch
from megarl.data.batch import Batch
from megarl.data.mini_batches import SHARE_META, ShareLayout
from megarl.workers.kept_rows import all_gather_objects, exchange_rows
from megarl.workers.offload import OffloadPolicy

logger = logging.getLogger("megarl.workers")
ROLES = ("actor", "reference", "critic", "reward_model")
TRAINED = ("actor", "critic")  # the roles with optimizer state: what a checkpoint saves
MAX_KEPT = 8  # results kept on a rank at most (a step keeps 2-3: old log-probs, reference log-probs, values)

# What each role method reads of its batch (`dispatch(reads=..., optional_reads=...)`: the controller sends a rank
# only these keys of its share). The mask travels under either name (`Batch.with_loss_mask`).
TOKENS = ("input_ids", "attention_mask")
MASKS = ("loss_mask", "response_mask")
# router replay: `rollout` replays vLLM's experts in the old-log-prob forward; `old` replays them in the update
FORWARD_OPTIONAL = (*MASKS, "rollout_routed_experts", "rollout_routing_mask", "routed_experts")
# the actor's old-log-prob forward also reads vLLM's log-probs (and, in a batch mixing weights versions, the versions)
# when it computes the mismatch rows (`mismatch=`)
OLD_FORWARD_OPTIONAL = (*FORWARD_OPTIONAL, "rollout_log_probs", "policy_version")
# advantages (absent only for an SFT loss); old_log_probs (absent: the update takes them from its own forward);
# (old and ref log-probs may instead be kept on the ranks: `kept=`); ref_log_probs with KL in the loss;
# rollout_log_probs with rollout correction (or the fused path's mismatch);
# routed_experts with router replay; teacher_top_k_ids / teacher_top_k_log_probs with distillation.top_k
# (or, one number per sequence, sequence_advantages [B]: expanded over the loss mask on the ranks, `per_sequence=`)
UPDATE_ACTOR_OPTIONAL = (*MASKS, "advantages", "sequence_advantages", "old_log_probs", "ref_log_probs",
                         "rollout_log_probs", "routed_experts", "teacher_top_k_ids", "teacher_top_k_log_probs")


class RoleHost:
    """The Megatron roles of one rank (see the module docstring). Attributes `actor`, `reference`, `critic`,
    `reward_model`: the role, or None where this host does not hold it; `offload[name]`: its `OffloadPolicy`
    (a no-op for an absent role); `events`: ("update", role) and ("offload", role, kinds in host memory) in call
    order (a `HybridWorker` shares its engine's deque so the step's phases are one sequence)."""

    def __init__(self, cfg: JobConfig, roles: Sequence[str], pool: str) -> None:
        """Build `roles` (names from ROLES, built in that order: a collective over the pool) of `cfg` on this rank.
        `pool`: the resource pool this host's group runs on (its RNG states are saved under that name)."""
        from megarl.roles.factory import build_role  # megatron-core: imported on the workers, not the controller

        unknown = sorted(set(roles) - set(ROLES))
        if unknown:
            raise ValueError(f"a RoleHost hosts roles among {ROLES}, not {unknown}")
        self.cfg = cfg
        self.pool = pool
        # with actor.lora the reference is the actor's base with its adapters off (`BaseOfActor`): no model, no
        # offload of its own
        base_reference = cfg.actor.lora is not None and "reference" in roles
        if base_reference and "actor" not in roles:
            raise ValueError("with actor.lora the reference is the actor's base: host it with the actor")
        for name in ROLES:
            if name == "reference" and base_reference:
                from megarl.roles.actor import BaseOfActor

                self.reference = BaseOfActor(self.actor)
                continue
            setattr(self, name, build_role(cfg, name, rank_offset=0) if name in roles else None)
        self.offload = {name: OffloadPolicy(None if name == "reference" and base_reference else getattr(self, name),
                                            cfg.role(name).offload) for name in ROLES}
        # distillation teachers (`distillation.teachers`) placed on this pool (the actor's, colocated, or the
        # teachers' own: `TeacherWorker`); their offload policies are `offload["teacher/<name>"]`
        self.teachers: dict[str, Any] = {}
        # teacher name -> compute_teacher_log_probs calls this rank served (where each teacher really ran)
        self.teacher_calls: collections.Counter = collections.Counter()
        from megarl.roles.teacher import build_teacher, teacher_pools

        for name in teacher_pools(cfg).get(pool, []):
            t = cfg.distillation.teachers[name]
            self.teachers[name] = build_teacher(t, dtype=cfg.model.dtype, seed=cfg.trainer.seed,
                                                samples_per_prompt=cfg.rollout.samples_per_prompt)
            self.offload[f"teacher/{name}"] = OffloadPolicy(self.teachers[name], t.offload)
        self.events: collections.deque = collections.deque(maxlen=256)
        # results kept where they were made (`keep=` of the forward methods), by name: (rows [lo, hi) of the batch,
        # seq len, {key: [hi - lo, S] tensor} or None off the last pipeline stage)
        self._kept: dict[str, tuple[tuple[int, int], int, Optional[dict]]] = {}

    @property
    def hosted_roles(self) -> list[str]:
        return [name for name in ROLES if getattr(self, name) is not None]

    def _role(self, name: str):
        role = getattr(self, name)
        if role is None:
            raise RuntimeError(f"no {name} role in this worker group (pool {self.pool!r} hosts "
                               f"{', '.join(self.hosted_roles)}); is {name}.enabled true and placed here?")
        return role

    def _offload(self, role: str, how: Callable[[], int]) -> int:
        """Run an `OffloadPolicy` method; record ("offload", role, kinds now in host memory) when it moved bytes."""
        moved = how()
        if moved:
            self.events.append(("offload", role, tuple(getattr(self, role).engine.offloaded)))
        return moved

    def _use(self, role: str, fn: Callable[[Any], Any]) -> Any:
        """`fn(role)` with the role's state on the device, offloaded again afterwards if its config asks to."""
        r = self._role(role)
        self.offload[role].before_use()
        out = fn(r)
        self._offload(role, self.offload[role].after_use)
        return out

    def _use_keep(self, role: str, fn: Callable[[Any], Any]) -> Any:
        """`fn(role)` with the role's state on the device, left there (its next use this step follows soon: the
        actor's old log-probs before its update, the critic's values before its update)."""
        r = self._role(role)
        self.offload[role].before_use()
        return fn(r)

    # ------------------------------------------------------------------------------------------- DP replicas
    def _dp_coord(self, role: str) -> tuple[int, int]:
        r = self._role(role)
        return r.dp_rank, r.dp

    def actor_dp(self) -> tuple[int, int]:
        """(this rank's actor DP rank, actor DP size): the replicas of the actor's DP_SPLIT calls."""
        return self._dp_coord("actor")

    def reference_dp(self) -> tuple[int, int]:
        return self._dp_coord("reference")

    def critic_dp(self) -> tuple[int, int]:
        return self._dp_coord("critic")

    def reward_model_dp(self) -> tuple[int, int]:
        return self._dp_coord("reward_model")

    def teacher_dp(self) -> tuple[int, int]:
        """(this rank's teacher DP rank, teacher DP size): the teachers of one pool have the same layout
        (validated), so one DP split of the batch serves them all."""
        if not self.teachers:
            raise RuntimeError(f"no distillation teachers in this worker group (pool {self.pool!r}); set "
                               "distillation.teachers")
        first = next(iter(self.teachers.values()))
        return first.dp_rank, first.dp

    @dispatch(Dispatch.ONE_TO_ALL)
    def teacher_call_counts(self) -> dict:
        """This rank's {"pool", "pid", "calls": {teacher name: compute_teacher_log_probs calls served}}: where each
        teacher really ran (one entry per rank of the group)."""
        return {"pool": self.pool, "pid": os.getpid(), "calls": dict(self.teacher_calls)}

    @dispatch(Dispatch.RANK_ZERO)
    def actor_corrects_rollout(self) -> bool:
        """Whether the actor's loss corrects for the rollout/train mismatch (its settings as built: tis or mask of
        algorithm.rollout_correction): its update then reads rollout_log_probs (the controller asks once and sends
        them to the update only then, or on the fused path)."""
        return bool(self._role("actor").loss.corrects_rollout)

    def actor_mini_batch_samples(self) -> Optional[int]:
        """The actor's global mini-batch size in samples (None = the whole batch): how the controller cuts
        `update_actor`'s batch (DP_SPLIT_MINI_BATCHES)."""
        return self._role("actor").batching.mini_batch_samples

    def critic_mini_batch_samples(self) -> Optional[int]:
        return self._role("critic").batching.mini_batch_samples

    # ------------------------------------------------------------------------------------------- kept results
    def _answer(self, share: Batch, result: Optional[Batch], keep: Optional[str],
                fetch: Optional[Sequence[str]]) -> Optional[Batch]:
        """A forward method's reply: with `keep`, its result is kept on this rank under that name (for a later
        update's `kept=`); `fetch`: the result keys the controller asked for (None: all; empty: none, None is
        returned), the ones the result has."""
        if keep is not None:
            if SPLIT_ROWS_META not in share.meta:
                raise ValueError(f"keep={keep!r} needs the controller's DP_SPLIT share (meta[{SPLIT_ROWS_META!r}])")
            lo, hi = share.meta[SPLIT_ROWS_META]
            self._keep(keep, (int(lo), int(hi)), share.seq_len, None if result is None else dict(result.tensors))
        if result is None or fetch is None:
            return result
        if not fetch:
            return None
        return Batch({k: result.tensors[k] for k in fetch if k in result.tensors}, dict(result.meta))

    def _keep(self, name: str, rows: tuple[int, int], seq_len: int, tensors: Optional[dict]) -> None:
        """Keep `tensors` ({key: [hi - lo, S]} of the batch's rows [lo, hi); None off the last pipeline stage) under
        `name` for a later update's `kept=`."""
        self._kept.pop(name, None)
        while len(self._kept) >= MAX_KEPT:  # results nobody read (a step that failed between): oldest first
            self._kept.pop(next(iter(self._kept)))
        self._kept[name] = ((int(rows[0]), int(rows[1])), seq_len, tensors)

    def _gae_here(self, share: Batch, values: Optional[Batch], gae: dict) -> Optional[Batch]:
        """`values` (this rank's compute_values result; None off the last stage) with advantages and returns [b, S]
        float32 of GAE over `share`'s scores and loss mask (`gae_on_share`); None off the last stage."""
        from megarl.algorithms.advantages import gae_on_share

        if values is None:
            return None
        if "scores" not in share:
            raise KeyError(f"compute_values(gae=...) needs scores [b] in its share; it has {sorted(share.keys())}: "
                           "put the step's scores in the batch before the call")
        critic = self._role("critic")
        lo, hi = share.meta[SPLIT_ROWS_META]
        gather = None
        if critic.dp > 1:  # the whitening's statistics are the whole batch's: every DP share's rows, here
            gather = functools.partial(all_gather_objects, group=critic.groups.pgs.dp)
        mask = share.with_loss_mask()["loss_mask"]
        advantages, returns = gae_on_share(share["scores"], values["values"], mask, float(gae["gamma"]),
                                           float(gae["lam"]), (int(lo), int(hi)), gather=gather)
        return values.update({"advantages": advantages, "returns": returns})

    def _with_kept(self, batch: Batch, kept: Optional[dict[str, tuple[str, str]]], method: str, role: str,
                   exchange: bool = False) -> Batch:
        """`batch` (this rank's update share, its layout in meta) plus, for each `batch key -> (kept name, result key)`
        of `kept`, this share's rows of that kept result (taken out of the store). Off the last pipeline stage, where
        no forward result exists and the loss never reads it, zeros of the same shape. `exchange` (the same on every
        rank: the controller's `WorkerGroup.results_stay` found the forward and update shares cut differently over
        the same DP ranks): the rows this rank's share needs and another DP peer kept come from that peer over
        `role`'s DP group, point to point (`megarl.workers.kept_rows.exchange_plan`); a collective of the group."""
        if not kept:
            return batch
        rows = ShareLayout.from_meta(batch.meta[SHARE_META]).rows
        extra = {}
        for key, (name, result_key) in kept.items():
            if name not in self._kept:
                raise KeyError(f"{method}: no result kept under {name!r} on this rank (kept: {sorted(self._kept)}); "
                               "the forward with keep= must run on this group before the update")
            (lo, hi), seq_len, tensors = self._kept[name]
            if not exchange and any(a < lo or b > hi for a, b in rows):
                raise ValueError(f"{method}: this rank kept rows [{lo}, {hi}) of {name!r} but its update share needs "
                                 f"{rows}: send {key} from the controller (WorkerGroup.results_stay is False here)")
            if tensors is None:
                if self._role(role).groups.is_last_stage:
                    raise ValueError(f"{method}: {name!r} was computed off this rank's last pipeline stage but "
                                     f"the {role}'s loss here reads {key}: send it from the controller")
                extra[key] = torch.zeros(len(batch), seq_len)
            elif exchange:
                extra[key] = exchange_rows(tensors[result_key], (lo, hi), rows, self._role(role).groups.pgs.dp)
            else:
                idx = torch.cat([torch.arange(a - lo, b - lo) for a, b in rows])
                extra[key] = tensors[result_key][idx]
        for name, _ in kept.values():
            self._kept.pop(name, None)
        return batch.update(extra)

    # ------------------------------------------------------------------------------------------- role methods
    @dispatch(Dispatch.DP_SPLIT, replica_attr="actor_dp", reads=TOKENS, optional_reads=OLD_FORWARD_OPTIONAL)
    def compute_log_probs(self, batch: Batch, keep: Optional[str] = None,
                          fetch: Optional[Sequence[str]] = None,
                          mismatch: Optional[dict] = None) -> Optional[Batch]:
        """`batch`: this actor DP rank's share (cut by the controller; the same on its TP ranks and pipeline stages;
        input_ids, attention_mask, response_mask [b, S]) -> actor log-probs (and entropy) of its tokens,
        token-aligned [b, S] float32; None off the last stage. The controller concatenates the shares in order.
        `keep`: also keep the result on this rank under that name (an update reads it with `kept=`); `fetch`: the
        result keys to return (None: all; empty: nothing comes back).
        `mismatch` ({"c": band, "versions": list of weights versions or None}): the result also holds the rows of
        the mismatch between these log-probs and vLLM's (`batch`'s rollout_log_probs; by version with versions,
        from its policy_version), [b] float32 each (`megarl.algorithms.rollout_correction.mismatch_rows`), always
        returned: the controller adds them up instead of fetching the log-probs."""
        out = self._use_keep("actor", lambda r: r.compute_log_probs(batch, share=True))
        if mismatch is not None and out is not None:
            from megarl.algorithms.rollout_correction import mismatch_rows

            b = batch.with_loss_mask()
            versions = mismatch.get("versions")
            rows = mismatch_rows(out["log_probs"], b["rollout_log_probs"], b["loss_mask"], float(mismatch["c"]),
                                 b["policy_version"] if versions else None, versions)
            out = out.update(rows)
            fetch = None if fetch is None else (*fetch, *rows)
        return self._answer(batch, out, keep, fetch)

    @dispatch(Dispatch.DP_SPLIT, replica_attr="reference_dp", reads=TOKENS, optional_reads=MASKS)
    def compute_ref_log_probs(self, batch: Batch, keep: Optional[str] = None,
                              fetch: Optional[Sequence[str]] = None) -> Optional[Batch]:
        """As `compute_log_probs`, with the reference's DP split: the reference's log_probs [b, S] float32 of each
        response token (0 elsewhere) on the last stage. The reference is offloaded afterwards per its config."""
        out = self._use("reference", lambda r: r.compute_log_probs(batch, with_entropy=False, share=True))
        return self._answer(batch, out, keep, fetch)

    @dispatch(Dispatch.DP_SPLIT, replica_attr="teacher_dp", reads=TOKENS, optional_reads=MASKS)
    def compute_teacher_log_probs(self, batch: Batch, teacher: str, keep: Optional[str] = None,
                                  fetch: Optional[Sequence[str]] = None, top_k: int = 0) -> Optional[Batch]:
        """As `compute_ref_log_probs`, with teacher `teacher` (a name of distillation.teachers): its log_probs
        [b, S] float32 of each of this share's response tokens (0 elsewhere) on its last stage; None elsewhere. The
        teacher is offloaded afterwards per its config. `keep`, `fetch` as in `compute_log_probs`. `top_k` > 0
        (distillation.top_k): also its top-k distribution at each response token, top_k_ids [b, S, k] int64 and
        top_k_log_probs [b, S, k] float32 (`Actor.compute_log_probs`)."""
        if teacher not in self.teachers:
            raise KeyError(f"no teacher {teacher!r} in this worker group (teachers: {sorted(self.teachers)})")
        role, policy = self.teachers[teacher], self.offload[f"teacher/{teacher}"]
        self.teacher_calls[teacher] += 1
        policy.before_use()
        out = role.compute_log_probs(batch, with_entropy=False, share=True, top_k=top_k)
        if policy.after_use():
            self.events.append(("offload", f"teacher/{teacher}", tuple(role.engine.offloaded)))
        return self._answer(batch, out, keep, fetch)

    @dispatch(Dispatch.DP_SPLIT, replica_attr="critic_dp", reads=TOKENS, optional_reads=(*MASKS, "scores"))
    def compute_values(self, batch: Batch, keep: Optional[str] = None,
                       fetch: Optional[Sequence[str]] = None, gae: Optional[dict] = None) -> Optional[Batch]:
        """This critic DP rank's share -> values [b, S] float32 (token-aligned, 0 outside the response) on the last
        stage; None elsewhere. The critic stays on the device for its update. `keep`, `fetch` as in
        `compute_log_probs`.
        `gae` ({"gamma", "lam", "keep_advantages": name}; with `keep`; the share then carries scores [b]): GAE runs
        here, on the values just computed (`megarl.algorithms.advantages.gae_on_share`: bit for bit the controller's
        `gae` over the whole batch; with several critic DP ranks the unwhitened advantages are all-gathered over the
        critic's DP group for the whitening's statistics). The result also holds returns [b, S] (kept with the
        values under `keep`, for `update_critic`'s `kept=`), and the advantages [b, S] are kept under
        `gae["keep_advantages"]` (for `update_actor`'s `kept=` on this same group); neither comes up unless
        fetched."""
        out = self._use_keep("critic", lambda r: r.compute_values(batch, share=True))
        if gae is not None:
            if keep is None:
                raise ValueError("compute_values(gae=...) keeps its advantages and returns on this rank: pass keep=")
            out = self._gae_here(batch, out, gae)
            if out is not None:
                lo, hi = batch.meta[SPLIT_ROWS_META]
                self._keep(gae["keep_advantages"], (int(lo), int(hi)), batch.seq_len,
                           {"advantages": out.tensors.pop("advantages")})
            else:
                self._keep(gae["keep_advantages"], tuple(batch.meta[SPLIT_ROWS_META]), batch.seq_len, None)
        return self._answer(batch, out, keep, fetch)

    @dispatch(Dispatch.DP_SPLIT, replica_attr="reward_model_dp", reads=TOKENS)
    def score(self, batch: Batch) -> Optional[Batch]:
        """This reward-model DP rank's share (input_ids, attention_mask [b, S]) -> scores [b] float32 read at each
        sequence's last real token, on the last stage. Offloaded afterwards per its config."""
        return self._use("reward_model", lambda r: r.score(batch, share=True))

    @dispatch(Dispatch.DP_SPLIT_MINI_BATCHES, replica_attr="actor_dp", mini_batch_attr="actor_mini_batch_samples",
              reads=TOKENS, optional_reads=UPDATE_ACTOR_OPTIONAL)
    def update_actor(self, batch: Batch, kept: Optional[dict[str, tuple[str, str]]] = None,
                     per_sequence: Optional[str] = None, exchange_kept: bool = False,
                     top_k_kl_coef: Optional[float] = None) -> dict[str, float]:
        """PPO/GSPO update of the actor over mini- and micro-batches (`actor.update`).

        `batch`: this actor DP rank's part of every mini-batch of the step's batch, concatenated in mini-batch
        order, with its layout in `meta` (cut by the controller, `megarl.data.mini_batches`; the same on its TP
        ranks and pipeline stages): input_ids, attention_mask, loss_mask (or response_mask) [b, S] int64;
        old_log_probs, advantages [b, S] float32; ref_log_probs with KL in the loss; rollout_log_probs with rollout
        correction. Returns the update's metrics over the whole batch (loss, KL, clip fraction, entropy, grad_norm,
        lr), identical on every rank. Afterwards the actor's gradients and optimizer state go to host memory when
        `actor.offload` asks for them: the reshard reads only the parameters.
        `kept`: batch key -> (name, result key) of results kept on this rank by a forward with `keep=` (old or
        reference log-probs), read here instead of sent (`_with_kept`); `exchange_kept`: the forward's shares were
        cut differently (several mini-batches over several DP ranks): the rows kept by DP peers come from them.
        `per_sequence`: the batch carries sequence_advantages [b] float32 instead of advantages (score-based
        estimators: one number per sequence), expanded here over its loss mask as this expansion
        (`megarl.algorithms.advantages.expand_per_sequence`; bit-identical to the controller's [b, S]).
        `top_k_kl_coef`: this update's weight of the top-k forward KL to the teachers (the run's
        distillation.top_k_coef with distillation.top_k, else 0.0; the batch then carries teacher_top_k_ids and
        teacher_top_k_log_probs [b, S, k]); None: the actor's loss as built. A session's workers outlive a run: the
        run's config decides the term, as it decides the advantages.
        """
        batch = self._with_kept(batch, kept, "update_actor", "actor", exchange=exchange_kept)
        if per_sequence is not None:
            batch = _expand_sequence_advantages(batch, per_sequence)
        metrics = self._use_keep("actor", lambda r: _update_with_top_k_coef(r, batch, top_k_kl_coef))
        self.events.append(("update", "actor"))
        self._offload("actor", self.offload["actor"].after_update)
        return metrics

    @dispatch(Dispatch.DP_SPLIT_MINI_BATCHES, replica_attr="critic_dp", mini_batch_attr="critic_mini_batch_samples",
              reads=TOKENS, optional_reads=(*MASKS, "returns", "old_values"))  # returns, old_values: or kept
    def update_critic(self, batch: Batch, kept: Optional[dict[str, tuple[str, str]]] = None,
                      exchange_kept: bool = False) -> dict[str, float]:
        """Value-loss update of the critic (`critic.update`). `batch` as in `update_actor` (cut for the critic's DP
        ranks and mini-batches), with returns and old_values [b, S] float32 instead of the policy keys -> the
        update's metrics (value_loss, value_clip_frac, value_mean, grad_norm, lr, tokens, ...), identical on every
        rank. Offloaded afterwards per `critic.offload`. `kept` as in `update_actor` (the values kept by
        `compute_values`, and the returns where GAE ran there: `compute_values(gae=)`; `exchange_kept` as there)."""
        batch = self._with_kept(batch, kept, "update_critic", "critic", exchange=exchange_kept)
        return self._use("critic", lambda r: r.update(batch, share=True))

    # ------------------------------------------------------------------------------------------- checkpoints
    @dispatch(Dispatch.RANK_ZERO)
    def save_checkpoint(self, step_dir: str) -> list[str]:
        """Full-state checkpoints of the trained roles held here under `step_dir` (actor/, critic/: weights,
        distributed optimizer, LR scheduler, step counter; each atomic) and this process's RNG states (`rng/`).
        Returns the names saved ([] on a host of frozen roles only, which saves nothing)."""
        from megarl.checkpoint.dist_ckpt import save_engine_checkpoint
        from megarl.checkpoint.train_state import save_rng

        trained = [name for name in TRAINED if getattr(self, name) is not None]
        if not trained:
            return []
        # The actor's pool writes the top-level model's HF config and tokenizer files beside its roles' weights (a
        # colocated critic included); a critic on its own pool builds its config from its spec.
        hf_dir = self.cfg.model.path if self.actor is not None else None
        for name in trained:
            self.offload[name].before_use()
            save_engine_checkpoint(getattr(self, name).engine, os.path.join(step_dir, name), hf_dir=hf_dir,
                                   with_optimizer=True)
        save_rng(step_dir, self.pool, dist.get_rank(), self._rng_layout())
        return trained

    @dispatch(Dispatch.RANK_ZERO)
    def load_checkpoint(self, step_dir: str) -> list[str]:
        """Load the trained roles held here from `step_dir` (any layout they were saved at): weights, and the
        optimizer, scheduler and step counter when the checkpoint has them (`has_optimizer_state`); RNG states when
        saved at this layout. Returns the roles loaded, each marked '+optimizer' when its optimizer state was
        restored ([] on a host of frozen roles only)."""
        from megarl.checkpoint.dist_ckpt import has_optimizer_state, load_engine_checkpoint
        from megarl.checkpoint.train_state import load_rng

        trained = [name for name in TRAINED if getattr(self, name) is not None]
        if not trained:
            return []
        loaded = []
        for name in trained:
            self.offload[name].before_use()
            path = os.path.join(step_dir, name)
            full = has_optimizer_state(path)
            load_engine_checkpoint(getattr(self, name).engine, path, with_optimizer=full)
            loaded.append(name + ("+optimizer" if full else ""))
        status = load_rng(step_dir, self.pool, dist.get_rank(), self._rng_layout())
        if status != "restored":
            logger.warning("rank %d RNG states %s", dist.get_rank(), status)
        return loaded

    def _rng_layout(self) -> str:
        """The layout an RNG checkpoint is valid for: the world size and each hosted role's topology."""
        return f"world {dist.get_world_size()}; " + "; ".join(
            f"{n} {getattr(self, n).groups.topology.describe()}" for n in self.hosted_roles)


class RoleWorker(RoleHost):
    """One rank of a role's own resource pool (HybridFlow's heterogeneous placement): a critic, reference or reward
    model away from the actor, with its own worker group, torch.distributed world, layout and model size. The
    controller passes it batches like any other group; calls on different pools can overlap
    (`group.method.submit(...)`)."""

    def __init__(self, cfg: JobConfig, role: str) -> None:
        """`cfg`: the whole job config (the role reads `cfg.role(role)`: model, layout, optimizer, offload).
        `role`: 'critic', 'reference' or 'reward_model'. Collective over the pool: every rank builds its share."""
        if role not in ("critic", "reference", "reward_model"):
            raise ValueError(f"RoleWorker hosts critic, reference or reward_model, not {role!r}")
        super().__init__(cfg, (role,), pool=cfg.role(role).pool)


class TeacherWorker(RoleHost):
    """One rank of a pool of distillation teachers' own (`distillation.teachers.<name>.pool` other than the actor's):
    the enabled teachers placed there, at their layout in this pool's torch.distributed world, nothing else. The
    controller calls `compute_teacher_log_probs` on this group as it would on the actor's."""

    def __init__(self, cfg: JobConfig, pool: str) -> None:
        """Collective over the pool: every rank builds its share of each teacher placed on `pool`."""
        from megarl.roles.teacher import teacher_pools

        if pool == cfg.actor.pool or pool not in teacher_pools(cfg):
            raise ValueError(f"TeacherWorker hosts teachers on a pool of their own; pool {pool!r} is not one (the "
                             f"actor's pool: {cfg.actor.pool!r}; the teachers' pools: {sorted(teacher_pools(cfg))})")
        super().__init__(cfg, (), pool=pool)


def _expand_sequence_advantages(batch: Batch, expansion: str) -> Batch:
    """`batch` with its sequence_advantages [b] replaced by advantages [b, S] over its loss mask (`expansion`, one of
    `megarl.algorithms.advantages.SEQUENCE_EXPANSIONS`)."""
    from megarl.algorithms.advantages import expand_per_sequence

    if "sequence_advantages" not in batch:
        raise KeyError(f"update_actor(per_sequence={expansion!r}) needs sequence_advantages [b] in its batch; it has "
                       f"{sorted(batch.keys())}: send them (RLLoop) or leave per_sequence out and send advantages")
    batch = batch.with_loss_mask()
    tensors = {k: v for k, v in batch.tensors.items() if k != "sequence_advantages"}
    tensors["advantages"] = expand_per_sequence(batch["sequence_advantages"], batch["loss_mask"], expansion)
    return Batch(tensors, dict(batch.meta))


def _update_with_top_k_coef(actor, batch: Batch, top_k_kl_coef: Optional[float]) -> dict[str, float]:
    """`actor.update(batch, share=True)` with its loss's top-k forward KL weight set to `top_k_kl_coef` for this call
    (None: as built)."""
    built = actor.loss
    if top_k_kl_coef is None or top_k_kl_coef == built.top_k_kl_coef:
        return actor.update(batch, share=True)
    actor.loss = dataclasses.replace(built, top_k_kl_coef=float(top_k_kl_coef))
    try:
        return actor.update(batch, share=True)
    finally:
        actor.loss = built
