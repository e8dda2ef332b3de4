"""The weight sync across pools (`rollout.pool` set), planned from the config alone (pure; no torch.distributed).

Bridge ranks: the actor's ranks 0..T-1 (its pool's world, natural order), then the rollout pool's T..T+R-1
(`megarl.controller.bridge`). The plan is `plan_reshard(spec, actor topology, InferLayout.pool(R, rollout.tp,
rank_offset=T))`: every rollout rank holds nothing and receives its whole vLLM shard; what only one actor rank holds
it sends, what several hold is levelled between them so the busiest actor rank sends the least any plan can
(`routing.route_pool`). The workers build the same plan (`megarl.workers.pool_sync`); `--dry-run` and
the start-up summary print its traffic (`pool_sync_lines`).
"""

from __future__ import annotations

from megarl.reshard.layouts import InferLayout, TrainLayout
from megarl.reshard.planner import ReshardPlan, plan_reshard

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def plan_pool_sync(cfg, spec, actor_topology, rollout_ranks: int) -> ReshardPlan:
    """The sync plan over the bridge: `actor_topology` (the actor in its pool's world: bridge ranks 0..T-1) ->
    `rollout.tp` engines filling `rollout_ranks` ranks (bridge ranks T..T+R-1), in the model dtype's element size,
    natural engine mapping (vLLM's external launcher: TP rank = position in the block)."""
    infer = InferLayout.pool(rollout_ranks, cfg.rollout.tp, rank_offset=actor_topology.world_size, ep=cfg.rollout.ep)
    return plan_reshard(spec, actor_topology, infer, dtype_bytes=ELEMENT_BYTES[cfg.model.dtype], search_mapping=False,
                        train_layout=TrainLayout.from_parallel(cfg.actor.parallel))


def config_pool_plan(cfg) -> ReshardPlan:
    """`plan_pool_sync` of a validated `JobConfig` with `rollout.pool` set, from its architecture and layouts."""
    from megarl.config.arch import spec_from_arch
    from megarl.config.placement import pool_size
    from megarl.config.validate import role_archs
    from megarl.parallel.topology import RoleTopology

    p = cfg.actor.parallel
    topo = RoleTopology(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, etp=p.etp)
    spec = spec_from_arch(role_archs(cfg)["actor"])
    return plan_pool_sync(cfg, spec, topo, pool_size(cfg.resources.pools[cfg.rollout.pool]))


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def pool_sync_lines(cfg) -> list[str]:
    """Lines describing the sync of a validated config with `rollout.pool` set: bridge ranks and bytes per rank."""
    plan = config_pool_plan(cfg)
    t = plan.traffic()
    train, infer = plan.train, plan.infer
    return [
        f"sync over the bridge: actor ranks -> bridge {train.ranks.start}..{train.ranks.stop - 1}, rollout ranks -> "
        f"bridge {infer.ranks.start}..{infer.ranks.stop - 1} ({infer.replicas} engine(s) x tp {infer.tp}), "
        f"{cfg.model.dtype}",
        f"sent per actor rank: max {_mb(t.max_sent)}, mean {_mb(t.mean_sent)} (max/mean {t.sent_imbalance:.3f}); "
        f"received per rollout rank: max {_mb(t.max_received)}, mean {_mb(t.mean_received)} (= its whole shard); "
        f"model {_mb(plan.model_bytes)}",
    ]
