"""Logit parity: the same token batch through transformers and through the Megatron model at a TP/PP layout.

`verify_ranks` is the per-rank body (under torchrun, or spawned by `verify` when not under torchrun): build the
model at the layout, load weights from the Megatron checkpoint (or straight from the HF directory), run the
batch through megatron's pipeline schedule, gather the vocab shards; rank 0 compares with transformers' eager
fp32 forward and returns the metrics.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
import torch.distributed as dist

from megarl.checkpoint.dist_ckpt import load_engine_checkpoint, read_meta
from megarl.checkpoint.engine_io import engine_logits, load_hf_into_engine
from megarl.checkpoint.errors import CheckpointError
from megarl.checkpoint.hf_io import HFReader
from megarl.checkpoint.name_map import LayoutError, validate_tp
from megarl.engine import MegatronEngine
from megarl.engine.megatron_engine import check_vpp
from megarl.models.spec import ModelSpec
from megarl.parallel.groups import build_role_groups
from megarl.parallel.topology import RoleTopology, TopologyError, layer_split
from megarl.platform.distributed import init_distributed
from megarl.platform.spawn import run_ranks

DEFAULT_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


def token_batch(vocab_size: int, batch: int = 2, seq: int = 32, seed: int = 0) -> torch.Tensor:
    """A fixed random batch [batch, seq] int64 (all rows the same length: the engine passes no attention mask)."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' own forward, fp32, eager attention: [batch, seq, vocab] float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = (ours.float() - ref.float()).abs()
    return {
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
        "argmax_agreement": float((ours.argmax(-1) == ref.argmax(-1)).float().mean()),
    }


def verify_topology(tp: int, pp: int, ep: int = 1, etp: Optional[int] = None) -> RoleTopology:
    """The layout `verify` runs: tp x pp with the fewest data-parallel replicas dp that megatron-core's expert grid
    allows (etp*ep must divide tp*dp: dp = etp*ep / gcd(tp, etp*ep); dp = ep when etp = tp, i.e. expert
    parallelism carved out of data parallelism; dp = 1 for tp=2, ep=2, etp=1, EP spanning the TP pair)."""
    expert = (tp if etp is None else etp) * ep
    return RoleTopology(tp=tp, pp=pp, dp=expert // math.gcd(tp, expert), ep=ep, etp=etp)


def check_layout(hf_dir: str, tp: int, pp: int, ep: int = 1, etp: Optional[int] = None,
                 vpp: int = 1) -> HFReader:
    """Validate the HF directory and the layout before any rank starts (raises CheckpointError)."""
    reader = HFReader(hf_dir)
    try:
        validate_tp(reader.spec, tp, etp)
        layer_split(reader.spec.num_layers, pp)
        try:
            check_vpp(reader.spec.num_layers, pp, vpp)
        except ValueError as e:
            raise CheckpointError(f"--vpp {vpp}: {e}") from None
        verify_topology(tp, pp, ep, etp)
        if (ep > 1 or (etp is not None and etp != tp)) and not reader.spec.is_moe:
            what = f"ep={ep}" if ep > 1 else f"etp={etp}"
            raise CheckpointError(f"{what} needs a mixture-of-experts model; {hf_dir} is a dense "
                                  f"{reader.spec.architecture}")
        if reader.spec.is_moe and reader.spec.num_experts % ep != 0:
            raise CheckpointError(f"ep={ep} does not divide num_experts={reader.spec.num_experts} of {hf_dir}")
    except (LayoutError, TopologyError) as e:
        raise CheckpointError(str(e)) from None
    return reader


def verify_ranks(rank: int, world_size: int, hf_dir: str, megatron_dir: Optional[str], tp: int, pp: int,
                 dtype: str, input_ids: torch.Tensor, tolerance: float, ep: int = 1,
                 etp: Optional[int] = None, vpp: int = 1) -> Optional[dict]:
    """Per-rank body; returns the metrics dict on rank 0 (None elsewhere). Collective over the world.

    The world is `verify_topology(tp, pp, ep, etp)`'s tp*pp*dp ranks: the dp data-parallel replicas run the same
    batch, each expert-parallel rank holds num_experts/ep experts, each sliced over etp ranks. `vpp`: virtual pipeline
    chunks per stage (megatron-core's interleaved schedule)."""
    topo = verify_topology(tp, pp, ep, etp)
    if world_size != topo.world_size:
        raise CheckpointError(f"verify at {topo.describe()} needs {topo.world_size} ranks, "
                              f"the world has {world_size}")
    spec = ModelSpec.from_hf_dir(hf_dir)
    groups = build_role_groups(topo)
    engine = MegatronEngine(spec, groups, dtype=dtype, vpp=vpp)
    if megatron_dir:
        load_engine_checkpoint(engine, megatron_dir)
    else:
        load_hf_into_engine(engine, hf_dir)
    logits = engine_logits(engine, input_ids)
    mine = logits if (logits is not None and groups.coord.tp == 0) else None
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return None
    ours = next(t for t in gathered if t is not None)
    result = compare_logits(ours, hf_logits(hf_dir, input_ids))
    result.update(tp=tp, pp=pp, ep=ep, etp=topo.expert_tp, dp=topo.dp, vpp=vpp, dtype=dtype, tolerance=tolerance,
                  source="megatron" if megatron_dir else "hf",
                  batch=list(input_ids.shape), passed=result["max_abs_logit_diff"] <= tolerance)
    return result


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def verify(hf_dir: str, megatron_dir: Optional[str], tp: int, pp: int, dtype: str = "fp32",
           tolerance: Optional[float] = None, batch: int = 2, seq: int = 32, seed: int = 0,
           ep: int = 1, etp: Optional[int] = None, vpp: int = 1) -> Optional[dict]:
    """Run the parity check; spawns `verify_topology`'s ranks unless already under torchrun. Metrics on rank 0."""
    reader = check_layout(hf_dir, tp, pp, ep, etp, vpp)
    if megatron_dir:
        read_meta(megatron_dir)
    tolerance = DEFAULT_TOLERANCE[dtype] if tolerance is None else tolerance
    ids = token_batch(reader.spec.vocab_size, batch, seq, seed)
    args = (hf_dir, megatron_dir, tp, pp, dtype, ids, tolerance, ep, etp, vpp)
    if under_torchrun():
        rank, world = init_distributed()
        return verify_ranks(rank, world, *args)
    return run_ranks(verify_topology(tp, pp, ep, etp).world_size, verify_ranks, *args, timeout_s=1800)[0]
