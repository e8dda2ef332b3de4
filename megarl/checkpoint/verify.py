"""Logit parity: the same token batch through transformers and through the Megatron model at a TP/PP layout.

`verify_ranks` is the per-rank body (under torchrun, or spawned by `verify` when not under torchrun): build the
model at the layout, load weights from the Megatron checkpoint (or straight from the HF directory), run the
batch through megatron's pipeline schedule, gather the vocab shards; rank 0 compares with transformers' eager
fp32 forward (`reference`) and returns `verdict`'s metrics.

How the verdict is decided (`verdict`): two correct implementations of the same model differ only by rounding, and
how much rounding moves the logits depends on the model (depth, logit magnitude, vocabulary). So the tolerance is
derived from the model itself: its noise floor is how far transformers' own forward moves when run one precision up
(fp32 vs fp64 for an fp32 check, bf16 vs fp32 for a bf16 one), max and mean |diff| over the same batch; the check
passes when both the max and the mean |logit diff| are within `NOISE_MULTIPLE` (4) times the floor. 4 = 2 (the
triangle bound: Megatron's forward and transformers' are each up to one floor away from the exact logits) x 2
(room for Megatron's path being up to twice as noisy as transformers': measured at TP3 on 12 layers the ratio is
at most ~1, `tests/distributed/test_checkpoint_layouts.py`). A layout bug moves fp32 logits by thousands of
floors (a swapped head or a missing qkv bias in one layer: >= 6e3); in bf16 the floor is ~2e4 times larger and
such a bug sits within a few floors, so a bf16 check only catches gross errors. A user tolerance (`atol`) replaces
the rule: max |diff| <= atol, and no noise-floor forward is run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
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

NOISE_MULTIPLE = 4.0

# The verified dtype -> the one-up precision its noise floor is measured against, both as transformers dtypes.
FLOOR_DTYPES = {"fp32": (torch.float32, torch.float64), "bf16": (torch.bfloat16, torch.float32)}


def token_batch(vocab_size: int, batch: int = 2, seq: int = 32, seed: int = 0) -> torch.Tensor:
    """A fixed random batch [batch, seq] int64 (all rows the same length: the engine passes no attention mask)."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' own forward, fp32, eager attention and experts: [batch, seq, vocab] float32."""
    return reference(hf_dir, input_ids, noise_floor=False).logits


@dataclass(frozen=True)
class HFReference:
    """What a Megatron forward is judged against.

    logits: [batch, seq, vocab] float32, transformers' eager fp32 forward.
    floor_max / floor_mean: max / mean |transformers at the verified dtype - transformers one precision up| over the
    same batch, logit units (None when not measured); floor_source says which two forwards.
    floor_routing_flips: for a mixture-of-experts model, how many (token, MoE layer) pairs the two forwards route to
    different top-k expert sets (None for a dense model or when not measured). A flip is a router near-tie that the
    two precisions break differently: it moves that token's logits by far more than rounding, so an fp32 floor
    measured over it is no rounding floor (`verdict` then refuses to pass).
    """

    logits: torch.Tensor
    floor_max: Optional[float] = None
    floor_mean: Optional[float] = None
    floor_source: Optional[str] = None
    floor_routing_flips: Optional[int] = None


def routing_flips(router_logits_a, router_logits_b, top_k: int) -> int:
    """How many (token, layer) pairs two forwards send to different top-k expert sets. Each argument: one
    [tokens, num_experts] router-logit tensor per MoE layer (transformers' `router_logits` output)."""
    flips = 0
    for a, b in zip(router_logits_a, router_logits_b, strict=True):
        chosen_a = a.topk(top_k, dim=-1).indices.sort(dim=-1).values
        chosen_b = b.topk(top_k, dim=-1).indices.sort(dim=-1).values
        flips += int((chosen_a != chosen_b).any(dim=-1).sum())
    return flips


def reference(hf_dir: str, input_ids: torch.Tensor, dtype: str = "fp32", noise_floor: bool = True) -> HFReference:
    """transformers' eager forward of `input_ids` [batch, seq] in fp32 and, with `noise_floor`, the noise floor of a
    `dtype` forward (`FLOOR_DTYPES`: the same model cast in place, so peak memory is the larger of the two copies,
    8 bytes per parameter for fp32's fp64 run).

    Eager throughout, attention and mixture-of-experts layers alike (`experts_implementation="eager"`: the
    per-expert loop of plain matmuls): every forward, and so both ends of the floor, runs the same code at each
    precision. transformers' default expert kernel (grouped_mm) refuses fp64, so the fp32 floor could not be
    measured with it. A mixture-of-experts model's two forwards are also compared expert choice by expert choice
    (`HFReference.floor_routing_flips`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager")
    model.eval()
    top_k = getattr(model.config, "num_experts_per_tok", None)  # None: a dense model
    kwargs = {"output_router_logits": True} if top_k and noise_floor else {}
    with torch.no_grad():
        out = model(input_ids, **kwargs)
        logits = out.logits.float()
        if not noise_floor:
            return HFReference(logits)
        low, high = FLOOR_DTYPES[dtype]
        other = high if low == torch.float32 else low  # fp32 has run: the other one, the model cast in place
        other_out = model.to(other)(input_ids, **kwargs)
        runs = {torch.float32: logits.double(), other: other_out.logits.double()}
    diff = (runs[low] - runs[high]).abs()
    name = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16"}
    flips = routing_flips(out.router_logits, other_out.router_logits, top_k) if kwargs else None
    return HFReference(logits, float(diff.max()), float(diff.mean()),
                     f"transformers {name[low]} vs {name[high]} forward, same batch", flips)


def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = (ours.float() - ref.float()).abs()
    return {
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
        "argmax_agreement": float((ours.argmax(-1) == ref.argmax(-1)).float().mean()),
    }


def verdict(ours: torch.Tensor, ref: HFReference, dtype: str = "fp32", atol: Optional[float] = None,
            multiple: float = NOISE_MULTIPLE) -> dict:
    """Judge Megatron's logits `ours` [batch, seq, vocab] against `ref` (module docstring: how and why).

    Returns compare_logits' metrics plus logit_scale (max |reference logit|), the noise floor (`noise_floor_max`,
    `noise_floor_mean`, `noise_floor_source`; each at least one rounding step of the logits: eps(dtype) x
    logit_scale for the max, eps(dtype) x mean |reference logit| for the mean), the tolerances (`tolerance` on the
    max, `tolerance_mean` on the mean, None when not judged), `tolerance_rule` in words, each diff over its floor,
    `noise_floor_routing_flips` (`HFReference.floor_routing_flips`) and `passed`. `atol`: the user's tolerance on the
    max diff instead of the rule (the floor is then reported only if `ref` has one). An fp32 floor over routing
    flips is no rounding floor: judged by the rule, such a check does not pass, and the rule says why and what to
    do; a bf16 floor keeps them (a bf16 forward breaks router near-ties its own way too, and bf16 judges gross
    errors only)."""
    result = compare_logits(ours, ref.logits)
    scale, eps = float(ref.logits.abs().max()), torch.finfo(FLOOR_DTYPES[dtype][0]).eps
    step_max, step_mean = eps * scale, eps * float(ref.logits.abs().mean())
    floor_max = None if ref.floor_max is None else max(ref.floor_max, step_max)
    floor_mean = None if ref.floor_mean is None else max(ref.floor_mean, step_mean)
    if atol is not None:
        tol_max, tol_mean, rule = atol, None, f"user --atol {atol:g} on the max |logit diff|"
    elif floor_max is None:
        raise ValueError("verdict needs a HFReference with a noise floor, or atol")
    else:
        tol_max, tol_mean = multiple * floor_max, multiple * floor_mean
        rule = (f"max and mean |logit diff| each <= {multiple:g} x the noise floor ({ref.floor_source}; "
                f"floors at least eps({dtype}) x max and mean |logit| = {step_max:.3g}, {step_mean:.3g})")
    floor_unusable = atol is None and dtype == "fp32" and bool(ref.floor_routing_flips)
    if floor_unusable:
        rule = (f"not judged: the noise floor's two forwards route {ref.floor_routing_flips} (token, MoE layer) "
                f"pairs to different experts (router near-ties), so their difference is no rounding floor; rerun "
                f"with another --seed (another batch), or judge with --atol")
    passed = not floor_unusable and result["max_abs_logit_diff"] <= tol_max and (
        tol_mean is None or result["mean_abs_logit_diff"] <= tol_mean)
    result.update(
        logit_scale=scale, noise_floor_max=floor_max, noise_floor_mean=floor_mean,
        noise_floor_source=ref.floor_source, noise_floor_routing_flips=ref.floor_routing_flips,
        tolerance=tol_max, tolerance_mean=tol_mean, tolerance_rule=rule,
        max_diff_over_floor=None if floor_max is None else result["max_abs_logit_diff"] / floor_max,
        mean_diff_over_floor=None if floor_mean is None else result["mean_abs_logit_diff"] / floor_mean,
        passed=passed,
    )
    return result


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
                 dtype: str, input_ids: torch.Tensor, atol: Optional[float] = None, ep: int = 1,
                 etp: Optional[int] = None, vpp: int = 1, multiple: float = NOISE_MULTIPLE) -> Optional[dict]:
    """Per-rank body; returns `verdict`'s dict on rank 0 (None elsewhere). Collective over the world.

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
    result = verdict(ours, reference(hf_dir, input_ids, dtype, noise_floor=atol is None), dtype, atol, multiple)
    passed = result.pop("passed")  # last in the JSON, after the layout
    result.update(tp=tp, pp=pp, ep=ep, etp=topo.expert_tp, dp=topo.dp, vpp=vpp, dtype=dtype,
                  source="megatron" if megatron_dir else "hf", batch=list(input_ids.shape), passed=passed)
    return result


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def verify(hf_dir: str, megatron_dir: Optional[str], tp: int, pp: int, dtype: str = "fp32",
           atol: Optional[float] = None, batch: int = 2, seq: int = 32, seed: int = 0,
           ep: int = 1, etp: Optional[int] = None, vpp: int = 1,
           multiple: Optional[float] = None) -> Optional[dict]:
    """Run the parity check; spawns `verify_topology`'s ranks unless already under torchrun, or runs a world of one
    (TP1, PP1, EP1) in this process. `verdict`'s dict on rank 0: `atol` None judges by `multiple` (default
    NOISE_MULTIPLE) x the model's noise floor, else max |logit diff| <= atol."""
    reader = check_layout(hf_dir, tp, pp, ep, etp, vpp)
    if megatron_dir:
        read_meta(megatron_dir)
    ids = token_batch(reader.spec.vocab_size, batch, seq, seed)
    multiple = NOISE_MULTIPLE if multiple is None else multiple
    args = (hf_dir, megatron_dir, tp, pp, dtype, ids, atol, ep, etp, vpp, multiple)
    if under_torchrun():
        rank, world = init_distributed()
        return verify_ranks(rank, world, *args)
    world = verify_topology(tp, pp, ep, etp).world_size
    if world == 1 and not dist.is_initialized():  # no rank to start: saves a second interpreter's imports
        try:
            return verify_ranks(*init_distributed(), *args)
        finally:
            dist.destroy_process_group()
    return run_ranks(world, verify_ranks, *args, timeout_s=1800)[0]
