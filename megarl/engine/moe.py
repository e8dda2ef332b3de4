"""megatron-core MoE routing, seen from a role: training settings, routing record/replay, load and aux-loss metrics.

The one module that touches megatron-core 0.16.1's router internals (`TopKRouter`, its `RouterReplay`, the MoE
aux-loss tracker). Everything is per engine: the routers are found in the engine's own model, so an actor and a
reference in one process do not see each other's routing (megatron's `RouterReplay.global_router_replay_instances`
class list, which spans every model built in the process, is never used).

Routing tensor layout (what `RoutingRecorder` returns and `RoutingReplayer` consumes), per micro-batch:
    routed_experts [b, s, L, k] int64 -- for each token, the k experts each MoE layer chose; L = every MoE layer of
    the model (global order, `ModelSpec.moe_layers`), filled only for the layers of this pipeline stage (0
    elsewhere: stages are combined by a sum over the pipeline group). megatron's router sees tokens sequence-first
    ([s*b, k] after `view(-1, E)` of [s, b, E]); the conversion is here. Under virtual pipeline parallelism
    (vpp > 1) a stage's layers sit in several chunks whose forwards of one micro-batch run at different times,
    interleaved with other micro-batches': the engine names the micro-batch before every chunk's forward, and each
    router writes (or replays) that micro-batch's columns. The schedule's filler micro-batches are not recorded.
    What is recorded is what the router handed to the token dispatcher: the True entries of its output routing map
    ([tokens, E] bool, the second output of `TopKRouter.forward`), in ascending expert order -- never the indices
    megarl asked a replaying router to use, so a replay that does not reach the router shows in the record.

Data path of `algorithm.router_replay: old`: the actor's old-log-prob forward records `routed_experts` [B, S, L, k]
into its result batch; the update's micro-batches carry their rows; before each micro-batch's forward the
replayer sets every router of this stage to REPLAY_FORWARD with the recorded indices, so the experts (and their
gates: the router's scores gathered at the replayed indices) are those of the recorded forward, whatever the
weights are now. The routing each router would have chosen itself is computed beside it (no grad) to measure the
fraction of tokens whose expert set differs (`routing_diff_frac`).

Data path of `algorithm.router_replay: rollout`: vLLM captures the experts it chose for every computed token
(`megarl.rollout.vllm_routing`; `RolloutSample.routed_experts` [p + r - 1, L, k]); `trajectories_to_batch` lays them out
as `rollout_routed_experts` [B, S, L, k] with `rollout_routing_mask` [B, S] (1 where vLLM routed the token: every
token but the last sampled one and padding). The old-log-prob forward replays them (`RoutingReplayer` with a mask:
the unmasked tokens take the router's own choice, computed in a forward pre-hook) and records the experts it used
(every token), which the update replays as for `old`. The fraction of replayed (token, layer) choices whose own
top-k set differs from vLLM's, measured in that forward, is `moe_rollout_routing_diff_frac`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

AUX_LOSS_TRACKER_NAMES = {"aux_loss": "load_balancing_loss", "z_loss": "z_loss"}


@dataclasses.dataclass(frozen=True)
class MoeSettings:
    """Training settings of a MoE model (unused for dense models).

    Attributes:
        aux_loss_coeff: weight of megatron-core's switch load-balancing loss (`aux_loss` type: E * sum_i f_i P_i per
            micro-batch and layer, f_i the fraction of routed slots, P_i the mean router probability of expert i);
            0 turns it off. With per-token loss normalisation megatron scales each micro-batch's aux loss by its
            token count, so its gradient is coeff * sum_mb(aux_mb * tokens_mb) / (the actor loss's units).
        z_loss_coeff: weight of the router z-loss (mean over tokens of logsumexp(router logits)^2), same scaling;
            0 = off.
        token_dispatcher: megatron-core's token dispatcher over the EP group: 'alltoall' or 'allgather'.
    """

    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    token_dispatcher: str = "alltoall"

    def __post_init__(self) -> None:
        if self.token_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(f"token_dispatcher must be 'alltoall' or 'allgather', got {self.token_dispatcher!r}")
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            raise ValueError(f"aux_loss_coeff and z_loss_coeff must be >= 0, got {self.aux_loss_coeff}, "
                             f"{self.z_loss_coeff}")


def enable_routing_hooks(config) -> None:
    """Give every router of a MoE model built from `config` megatron-core's `RouterReplay` (set before the model is
    built). With no action set it computes the top-k exactly as without it; it is how routing is recorded and
    replayed. (The aux/z-loss coefficients and dispatcher go into the config at construction:
    `megarl.models.gpt.build_transformer_config`.)"""
    if config.num_moe_experts:
        config.moe_enable_routing_replay = True


def moe_routers(module) -> list:
    """This stage's `TopKRouter`s in layer order (their `layer_number` is global, 1-based)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
    return sorted(routers, key=lambda r: r.layer_number)


def moe_layer_slots(spec) -> dict[int, int]:
    """Global layer index (0-based) -> column of that layer in a routed_experts tensor (MoE layers only)."""
    return {layer: i for i, layer in enumerate(j for j, m in enumerate(spec.moe_layers) if m)}


class _RouterHooks:
    """Forward hooks on this stage's routers, alive for one `run` (a context manager)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.spec = engine.spec
        # sequence parallelism (MoE at tp > 1): each TP rank routes its slice of the (tp-padded) sequence
        self.sp = bool(engine.config.sequence_parallel)
        self.tp = engine.groups.topology.tp
        self.tp_rank = engine.groups.coord.tp
        self.slots = moe_layer_slots(engine.spec)
        self.routers = moe_routers(engine.module)
        self._handles: list = []

    def _slot(self, router) -> int:
        return self.slots[router.layer_number - 1]

    def __enter__(self):
        for router in self.routers:
            self._handles.append(router.register_forward_hook(self._hook, with_kwargs=True))
        self._set_action()
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for router in self.routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()

    def _set_action(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for router in self.routers:
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    def _hook(self, router, args, kwargs, output) -> None:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError(f"{type(self).__name__} must define _hook (what to do after each router forward)")


class RoutingRecorder(_RouterHooks):
    """Records every router's top-k per micro-batch and the tokens each expert received.

    The engine announces every forward before it runs: `begin_micro_batch(mb, index, fed)` for micro-batch `index`
    of the run (under the interleaved schedule, vpp > 1, each micro-batch's forward is split over this stage's
    chunks and those of different micro-batches interleave: the routers of a chunk write to the micro-batch whose
    forward runs them), `begin_filler()` for a schedule filler (nothing recorded or counted; its routers choose by
    themselves).

    After the run: `routed_experts(i)` [b, s, L, k] of micro-batch i (this stage's layers filled), and
    `tokens_per_expert` [L, E] float64 summed over this rank's micro-batches (real tokens: positions the engine's
    padding mask marks as padding, and the schedule's uniform padding under vpp > 1, are routed but not counted).
    """

    def __init__(self, engine, keep_indices: bool = True) -> None:
        super().__init__(engine)
        self.keep_indices = keep_indices
        self._per_mb: dict[int, dict[int, torch.Tensor]] = {}
        self._shape: dict[int, tuple[int, int]] = {}  # index -> the micro-batch's own [b, s]
        self._fed: dict[int, tuple[int, int]] = {}  # index -> [rows, length] the engine fed (before CP / SP split)
        self._current: Optional[int] = None  # the micro-batch whose forward runs now (None: a filler)
        self._counted: Optional[torch.Tensor] = None  # [local tokens] bool, sequence-first: not schedule padding
        self.tokens_per_expert = torch.zeros(len(self.slots), engine.spec.num_experts, dtype=torch.float64)

    def begin_micro_batch(self, mb: dict, index: Optional[int] = None, fed: Optional[torch.Tensor] = None) -> None:
        """Called by the engine before each forward of micro-batch `index` (default: the next one). `fed` [rows,
        length] bool: the token grid the engine feeds for it (its own tokens, padded to a multiple of tp / 2*cp, and
        under vpp > 1 to the schedule's uniform shape), True where a position belongs to the micro-batch (its own
        padded [b, s']), False for the schedule's extra padding; None = exactly the micro-batch."""
        index = len(self._shape) if index is None else index
        if fed is None:
            fed = torch.ones(mb["input_ids"].shape, dtype=torch.bool)
        if index not in self._shape:
            self._shape[index] = tuple(mb["input_ids"].shape)
            self._fed[index] = tuple(fed.shape)
            self._per_mb[index] = {}
        self._current = index
        if self.engine.groups.topology.cp > 1:
            from megarl.models.context_parallel import split_for_cp_rank

            fed = split_for_cp_rank(fed, self.engine.groups.topology.cp, self.engine.groups.coord.cp)
        if self.sp:
            fed = sequence_parallel_slice(fed, self.tp, self.tp_rank)
        self._counted = fed.transpose(0, 1).reshape(-1)
        self._set_action()

    def begin_filler(self) -> None:
        """Called by the engine before a filler forward (vpp > 1): its routing is neither recorded nor counted."""
        self._current = None
        for router in self.routers:
            router.router_replay.clear_router_replay_action()

    def _record(self, router, top_indices: torch.Tensor, args, kwargs) -> None:
        if self._current is None:
            return
        idx = top_indices.detach().to("cpu", torch.int64)
        slot = self._slot(router)
        pad = args[1] if len(args) > 1 else kwargs.get("padding_mask")  # [s, b] True = padding (or None)
        counted = self._counted if pad is None else self._counted & ~pad.reshape(-1).cpu()
        self.tokens_per_expert[slot] += torch.bincount(idx[counted].reshape(-1),
                                                       minlength=self.spec.num_experts).double()
        if self.keep_indices:
            self._per_mb[self._current][slot] = idx

    def _hook(self, router, args, kwargs, output) -> None:
        self._record(router, dispatched_experts(output[1], router.topk), args, kwargs)

    def routed_experts(self, i: int) -> torch.Tensor:
        """[b, s, L, k] int64 of micro-batch i (zeros for the layers of other stages). Collective over the TP group
        under sequence parallelism (the slices are gathered)."""
        b, s = self._shape[i]
        rows, length = self._fed[i]
        local = length // self.tp if self.sp else length
        out = torch.zeros(rows, local, len(self.slots), self.spec.moe_topk, dtype=torch.int64)
        for slot, idx in self._per_mb[i].items():
            out[:, :, slot] = idx.view(local, rows, -1).transpose(0, 1)
        if self.sp:
            from megarl.platform.device import compute_device

            parts = [torch.empty_like(out, device=compute_device()) for _ in range(self.tp)]
            dist.all_gather(parts, out.to(compute_device()).contiguous(), group=self.engine.groups.pgs.tp)
            out = torch.cat([p.cpu() for p in parts], dim=1)
        return out[:b, :s]


class RoutingReplayer(RoutingRecorder):
    """Forces every router to given experts and measures how many of the replayed (token, layer) choices the router
    would have made differently on its own.

    Each micro-batch carries the experts in `mb[key]` [b, s, L, k] (`routed_experts`: a recorded forward's, for
    `old`; `rollout_routed_experts`: vLLM's, for `rollout`) and, when `mask_key` is given, `mb[mask_key]` [b, s]
    (1 = replay this token; 0 = the router chooses by itself: the tokens vLLM never routed, i.e. the last sampled
    token and padding). The counted tokens are the valid (`attention_mask` 1) replayed ones: `tokens` (x this
    stage's MoE layers) and `tokens_differing` (own top-k set != replayed set), which `moe_update_metrics` turns into
    `moe_routing_diff_frac`. With `keep_indices` the experts the router actually dispatched to (its output routing
    map, not the replay target) are recorded (`routed_experts(i)`).
    """

    def __init__(self, engine, keep_indices: bool = False, key: str = "routed_experts",
                 mask_key: Optional[str] = None) -> None:
        super().__init__(engine, keep_indices=keep_indices)
        self.key, self.mask_key = key, mask_key
        self._target: Optional[torch.Tensor] = None
        self._replayed: Optional[torch.Tensor] = None
        self._valid: Optional[torch.Tensor] = None
        self.tokens = 0.0  # replayed valid tokens x MoE layers of this stage, summed over micro-batches
        self.tokens_differing = 0.0

    def __enter__(self):
        if self.mask_key is not None:  # tokens not replayed take the router's own choice, computed first
            for router in self.routers:
                self._handles.append(router.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        return super().__enter__()

    def _set_action(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for router in self.routers:
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def begin_micro_batch(self, mb: dict, index: Optional[int] = None, fed: Optional[torch.Tensor] = None) -> None:
        super().begin_micro_batch(mb, index, fed)
        if self.key not in mb:
            raise KeyError(f"router replay needs {self.key!r} [b, s, L, k] in every micro-batch (record them in "
                           "the old-log-prob forward: Actor.compute_log_probs(record_routing=True), or capture "
                           "vLLM's: algorithm.router_replay=rollout)")
        target, valid = mb[self.key], mb["attention_mask"]  # [b, s, L, k], [b, s]
        replayed = mb[self.mask_key] if self.mask_key is not None else torch.ones_like(valid)
        rows, length = self._fed[self._current]
        extra_len, extra_rows = length - target.shape[1], rows - target.shape[0]
        if extra_len or extra_rows:  # the engine's padding (tp, uniform shape under vpp > 1): valid 0, expert 0
            target = torch.nn.functional.pad(target, (0, 0, 0, 0, 0, extra_len, 0, extra_rows))
            valid, replayed = (torch.nn.functional.pad(t, (0, extra_len, 0, extra_rows)) for t in (valid, replayed))
        if self.sp:  # this TP rank's slice of the tp-padded sequence (padding: valid 0)
            target, valid, replayed = (sequence_parallel_slice(t, self.tp, self.tp_rank)
                                       for t in (target, valid, replayed))
        b, s = target.shape[:2]
        self._target = target.transpose(0, 1).reshape(s * b, *target.shape[2:]).long()  # sequence-first tokens
        self._replayed = replayed.transpose(0, 1).reshape(-1).bool()
        self._valid = valid.transpose(0, 1).reshape(-1).bool().cpu() & self._replayed.cpu()
        for router in self.routers:
            router.router_replay.target_topk_idx = self._target[:, self._slot(router)]
            router.router_replay.replay_backward_list = []

    def _own_top_k(self, router, hidden: torch.Tensor) -> torch.Tensor:
        """[tokens, k] the experts this router picks by itself for `hidden` (no grad)."""
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        with torch.no_grad():
            logits = router.gating(hidden).view(-1, router.config.num_moe_experts)
            _, own_map = topk_routing_with_score_function(
                logits, router.topk, use_pre_softmax=router.config.moe_router_pre_softmax,
                num_groups=router.config.moe_router_num_groups, group_topk=router.config.moe_router_group_topk,
                score_function=router.score_function, expert_bias=router.expert_bias,
            )
        return own_map

    def _pre_hook(self, router, args, kwargs):
        if self._current is None:  # a filler: the router chooses by itself
            return
        own_map = self._own_top_k(router, args[0] if args else kwargs["input"])
        own = own_map.float().topk(router.topk, dim=-1).indices.sort(-1).values.cpu()
        slot = self._slot(router)
        target = torch.where(self._replayed.to(own.device)[:, None], self._target[:, slot].to(own.device), own)
        router.router_replay.target_topk_idx = target

    def _hook(self, router, args, kwargs, output) -> None:
        if self._current is None:
            return
        target = router.router_replay.target_topk_idx  # what was asked for: the diff fraction's reference
        used = dispatched_experts(output[1], router.topk, fallback=target, must=self._valid)  # what the router used
        self._record(router, used, args, kwargs)
        own_map = self._own_top_k(router, args[0] if args else kwargs["input"])
        differs = routing_sets_differ(own_map, target.to(own_map.device)).cpu() & self._valid
        self.tokens += float(self._valid.sum())
        self.tokens_differing += float(differs.sum())


def dispatched_experts(routing_map: torch.Tensor, k: int, fallback: Optional[torch.Tensor] = None,
                       must: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[tokens, k] int64, ascending: the experts a router dispatched each token to, from its output routing map
    [tokens, E] bool (True = the token goes to that expert). A token not dispatched to exactly k experts raises
    (megatron's token dropping, `moe_expert_capacity_factor`, which megarl does not set) unless `must` [tokens] bool
    marks it as not counted (a padding position, whose replay target may repeat an expert): its row is then
    `fallback` [tokens, k] (the target asked for)."""
    counts = routing_map.sum(-1)
    odd = counts != k
    if not bool(odd.any()):
        return routing_map.nonzero()[:, 1].view(-1, k)  # row-major: each row's experts in ascending order
    counted = odd if must is None else odd & must.to(odd.device).bool()
    if fallback is None or bool(counted.any()):
        bad = int(counted.sum()) if fallback is not None else int(odd.sum())
        raise RuntimeError(f"{bad} of {routing_map.shape[0]} tokens were dispatched to other than {k} experts "
                           "(token dropping is not supported by the routing record)")
    out = fallback.to(routing_map.device).long().clone()
    good = ~odd
    out[good] = routing_map[good].nonzero()[:, 1].view(-1, k)
    return out


def routing_sets_differ(own_map: torch.Tensor, replayed: torch.Tensor) -> torch.Tensor:
    """[tokens] bool: whether a token's own expert set (`own_map` [tokens, E] bool, True = chosen) differs from the
    replayed one (`replayed` [tokens, k] expert indices); order within the k does not matter."""
    replay_map = torch.zeros_like(own_map).scatter(1, replayed.long(), True)
    return (own_map != replay_map).any(-1)


def sequence_parallel_slice(t: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's slice along dim 1 of a [b, s, ...] tensor padded with zeros to a multiple of tp (megatron's
    sequence-parallel split of the tp-padded sequence)."""
    s = t.shape[1]
    chunk = padded_len(s, tp) // tp
    pad = padded_len(s, tp) - s
    padded = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return padded[:, tp_rank * chunk:][:, :chunk]


def aux_loss_tracker_clear() -> None:
    """Zero megatron-core's process-wide MoE aux-loss tracker (call before a training run of one engine)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def aux_loss_values(spec) -> dict[str, torch.Tensor]:
    """Per MoE layer of this stage [L] float64, summed over the micro-batches since the last clear, of the unscaled
    aux losses megatron-core tracked ('aux_loss', 'z_loss'; zeros for a loss that is off or a layer elsewhere)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    slots = moe_layer_slots(spec)
    out = {}
    for name, tracked in AUX_LOSS_TRACKER_NAMES.items():
        vals = torch.zeros(len(slots), dtype=torch.float64)
        if tracked in tracker:
            per_layer = tracker[tracked]["values"].detach().double().cpu()
            for layer, slot in slots.items():
                vals[slot] = per_layer[layer]
        out[name] = vals
    return out


def padded_len(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def reduce_over_role(t: torch.Tensor, groups, device, dp_op=dist.ReduceOp.SUM, tp_sum: bool = False) -> torch.Tensor:
    """Combine a per-rank tensor over the role: a sum over TP when `tp_sum` (sequence parallelism: TP ranks hold
    different tokens; otherwise the same ones, not combined), `dp_op` over dp*cp (token shares), then a sum over the
    pipeline group (each stage fills its own layers)."""
    t = t.to(device)
    if tp_sum and groups.topology.tp > 1:
        dist.all_reduce(t, group=groups.pgs.tp)
    if groups.topology.dp * groups.topology.cp > 1:
        dist.all_reduce(t, op=dp_op, group=groups.pgs.dp_cp)
    if groups.topology.pp > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=groups.pgs.pp)
    return t.cpu()


def load_metrics(tokens_per_expert: torch.Tensor) -> dict[str, float]:
    """Expert-load metrics from [L, E] routed-token counts (whole role): per layer max/mean tokens per expert
    (`moe_load_max_over_mean_l{i}`, i = MoE layer index), their mean over layers and the worst layer."""
    mean = tokens_per_expert.mean(-1).clamp(min=1e-12)
    ratio = tokens_per_expert.max(-1).values / mean
    out = {f"moe_load_max_over_mean_l{i}": float(r) for i, r in enumerate(ratio)}
    out["moe_load_max_over_mean"] = float(ratio.mean())
    out["moe_load_max_over_mean_max"] = float(ratio.max())
    return out


def moe_update_metrics(engine, recorders: list) -> dict[str, float]:
    """The MoE metrics of one update (identical on every rank of the role), from its runs' recorders and megatron's
    aux-loss tracker (cleared before the update):

      moe_aux_loss, moe_z_loss: the unscaled load-balancing / z-loss (coefficient divided out), mean over
        micro-batches (all DP ranks) and MoE layers (0 when its coefficient is 0: not computed);
      moe_load_max_over_mean[_l{i}|_max]: `load_metrics` of the tokens each expert received over the update;
      moe_routing_diff_frac (replayed updates only): valid tokens x MoE layers whose own top-k expert set differs
        from the replayed (recorded) one, over all of them.
    """
    from megarl.platform.device import compute_device

    groups = engine.groups
    device = compute_device()
    sp = bool(engine.config.sequence_parallel)
    tokens = reduce_over_role(sum(r.tokens_per_expert for r in recorders), groups, device, tp_sum=sp)
    out = load_metrics(tokens)
    aux = aux_loss_values(engine.spec)
    n_mb = float(sum(len(r._shape) for r in recorders))
    packed = torch.cat([aux["aux_loss"], aux["z_loss"], torch.tensor([n_mb], dtype=torch.float64)])
    # under sequence (context) parallelism a TP (CP) rank's aux loss is its share of the micro-batch's (sum over
    # TP, CP) and its z-loss the mean over its own tokens (mean over TP, CP); the micro-batch count was summed over
    # stages (and TP, CP) too
    packed = reduce_over_role(packed, groups, device, tp_sum=sp)
    layers = len(aux["aux_loss"])
    tp = groups.topology.tp if sp else 1
    cp = groups.topology.cp
    n_mb_total = max(float(packed[-1]) / (groups.topology.pp * tp * cp), 1.0)
    out["moe_aux_loss"] = float(packed[:layers].mean()) / n_mb_total
    out["moe_z_loss"] = float(packed[layers:2 * layers].mean()) / (tp * cp) / n_mb_total
    replayers = [r for r in recorders if isinstance(r, RoutingReplayer)]
    if replayers:
        out["moe_routing_diff_frac"] = routing_diff_frac(engine, replayers)
    return out


def routing_diff_frac(engine, replayers: list) -> float:
    """Replayed (valid token, MoE layer) choices whose own top-k set differs from the replayed one, over all of them,
    summed over the replayers' micro-batches and the whole role (collective over the role; same on every rank;
    0 when nothing was replayed)."""
    from megarl.platform.device import compute_device

    diff = torch.tensor([sum(r.tokens_differing for r in replayers), sum(r.tokens for r in replayers)],
                        dtype=torch.float64)
    diff = reduce_over_role(diff, engine.groups, compute_device(), tp_sum=bool(engine.config.sequence_parallel))
    return float(diff[0] / diff[1]) if diff[1] > 0 else 0.0
