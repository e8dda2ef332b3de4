"""The reshard planner on mixture-of-experts models and the remaining Megatron layouts (EP, ETP, uneven PP, VPP),
into vLLM's fused-MoE layout (TP-sliced experts, or whole experts under vLLM EP).

The expected bytes come from an independent model written here: element masks of every HF tensor, one for what a
training rank holds (megatron-core's rules, restated from its source: expert grid etp-ep-edp per stage, ep rank r
holds experts [r*E/ep, (r+1)*E/ep), vocab padded to 128*tp, interleaved chunks for VPP) and one for what a vLLM rank
needs (vLLM's rules: 1/tp slice of every expert, or whole experts placed linearly under EP; vocab padded to 64).
The lower bound of a rank is the number of needed elements it does not hold; no code of `megarl.reshard` is used
to compute it.
"""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.name_map import FAMILIES
from megarl.models.spec import ModelSpec
from megarl.parallel.topology import RoleTopology
from megarl.reshard.layouts import TrainLayout, split_expert_slot, vllm_needs, vllm_param_shapes
from megarl.reshard.planner import plan_reshard

QWEN3_MOE = ModelSpec(
    architecture="Qwen3MoeForCausalLM", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    head_dim=32, ffn_hidden_size=96, vocab_size=300, max_position_embeddings=128, qk_layernorm=True,
    num_experts=4, moe_topk=2, moe_ffn_hidden_size=32, moe_layers=(True, True, True, True),
)
MIXTRAL = ModelSpec(
    architecture="MixtralForCausalLM", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    head_dim=32, ffn_hidden_size=32, vocab_size=300, max_position_embeddings=128,
    num_experts=8, moe_topk=2, moe_ffn_hidden_size=32,
)
QWEN2_MOE = ModelSpec(  # shared expert with its sigmoid gate, q/k/v bias, tied embeddings, layer 0 dense
    architecture="Qwen2MoeForCausalLM", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    head_dim=16, ffn_hidden_size=96, vocab_size=300, max_position_embeddings=128, qkv_bias=True,
    tie_word_embeddings=True, num_experts=4, moe_topk=2, moe_ffn_hidden_size=32, moe_layers=(False, True, True, True),
    shared_expert_ffn_hidden_size=48,
)
SPECS = {"qwen3moe": QWEN3_MOE, "mixtral": MIXTRAL, "qwen2moe-shared-tied": QWEN2_MOE}

# (tp, pp, dp, ep, etp, vpp, first, last, infer_tp, infer_ep)
LAYOUTS = [
    (1, 1, 2, 2, None, 1, None, None, 2, False),   # EP2 -> TP2 (the 2-rank case)
    (1, 1, 2, 2, None, 1, None, None, 1, False),   # EP2 -> two TP1 replicas
    (2, 1, 2, 2, None, 1, None, None, 2, False),   # TP2xEP2 -> TP2 (4 ranks)
    (2, 1, 2, 2, 1, 1, None, None, 2, False),      # TP2xEP2 with expert TP 1
    (2, 1, 2, 2, None, 1, None, None, 4, False),   # TP2xEP2 -> TP4
    (1, 2, 2, 2, None, 1, None, None, 2, False),   # PP2xEP2 -> TP2
    (1, 2, 2, 2, None, 1, 1, None, 2, False),      # uneven PP: 1 + 3 layers
    (1, 2, 2, 2, None, 1, None, 1, 4, False),      # uneven PP: 3 + 1 layers
    (1, 2, 2, 1, None, 2, None, None, 2, False),   # VPP 2: stage 0 holds layers 0, 2; stage 1 layers 1, 3
    (1, 2, 2, 2, None, 2, None, None, 4, False),   # VPP 2 and EP2
    (2, 1, 4, 4, None, 1, None, None, 2, False),   # TP2xEP4 over 8 ranks
    (1, 1, 4, 4, None, 1, None, None, 4, True),    # EP4 -> vLLM TP4 with EP (whole experts)
    (1, 1, 4, 2, None, 1, None, None, 4, True),    # EP2 -> vLLM EP4
    (2, 1, 2, 2, 1, 1, None, None, 2, True),       # TP2xEP2 (ETP1) -> vLLM EP2: expert bytes stay local
    (1, 2, 4, 4, None, 1, None, None, 4, False),   # PP2xEP4 -> TP4 (8 ranks)
    (2, 1, 1, 2, 1, 1, None, None, 2, False),      # TP2xEP2xETP1 on 2 ranks: EP spans the TP pair -> TP2
    (2, 1, 1, 2, 1, 1, None, None, 2, True),       # the same -> vLLM EP2
    (1, 1, 2, 1, 2, 1, None, None, 2, False),      # expert TP 2 above TP 1 (dp2) -> TP2
    (1, 1, 4, 2, 2, 1, None, None, 4, False),      # EP2xETP2 at TP1 (dp4) -> TP4
    (2, 2, 2, 4, 1, 1, None, None, 2, False),      # PP2 x TP2 with EP4 x ETP1 over each stage's 4 ranks -> TP2
]


def _train_layout(first, last, vpp):
    return TrainLayout(first_stage_layers=first, last_stage_layers=last, vpp=vpp)


# --------------------------------------------------------------- the independent model: element masks per HF tensor
def _hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes restated from the HF configs' semantics (not from name_map)."""
    f = FAMILIES[spec.architecture]
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    out = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        out.update({f["input_norm"].format(i=i): (h,), f["post_attn_norm"].format(i=i): (h,),
                    f["q"].format(i=i, p="weight"): (q, h), f["k"].format(i=i, p="weight"): (kv, h),
                    f["v"].format(i=i, p="weight"): (kv, h), f["o"].format(i=i, p="weight"): (h, q)})
        if spec.qkv_bias:
            out.update({f["q"].format(i=i, p="bias"): (q,), f["k"].format(i=i, p="bias"): (kv,),
                        f["v"].format(i=i, p="bias"): (kv,)})
        if spec.qk_layernorm:
            out.update({f["q_norm"].format(i=i): (d,), f["k_norm"].format(i=i): (d,)})
        if spec.is_moe_layer(i):
            m = spec.moe_ffn_hidden_size
            out[f["router"].format(i=i)] = (spec.num_experts, h)
            for e in range(spec.num_experts):
                out.update({f["expert_gate"].format(i=i, e=e): (m, h), f["expert_up"].format(i=i, e=e): (m, h),
                            f["expert_down"].format(i=i, e=e): (h, m)})
            s = spec.shared_expert_ffn_hidden_size
            if s:
                out.update({f["shared_gate"].format(i=i): (s, h), f["shared_up"].format(i=i): (s, h),
                            f["shared_down"].format(i=i): (h, s), f["shared_expert_gate"].format(i=i): (1, h)})
        else:
            ffn = spec.ffn_hidden_size
            out.update({f["gate"].format(i=i): (ffn, h), f["up"].format(i=i): (ffn, h),
                        f["down"].format(i=i): (h, ffn)})
    return out


def _kind(spec: ModelSpec, name: str) -> str:
    """'rows' (split along rows), 'cols' (along columns) or 'whole' (replicated), from the HF tensor's role."""
    if name.endswith(("norm.weight", "layernorm.weight", "mlp.gate.weight", "block_sparse_moe.gate.weight",
                      "shared_expert_gate.weight")):
        return "whole"
    if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
        return "cols"
    return "rows"


def _slice(mask: torch.Tensor, kind: str, lo: int, hi: int) -> None:
    if kind == "cols":
        mask[:, lo:hi] = True
    else:
        mask[lo:hi] = True


def _layer_of(name: str):
    parts = name.split(".")
    return int(parts[2]) if parts[1] == "layers" else None


def _expert_of(name: str):
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


def _held(spec, tp, pp, dp, ep, etp, vpp, first, last, rank) -> dict[str, torch.Tensor]:
    etp = etp or tp
    per_stage = tp * dp
    stage, s = rank // per_stage, rank % per_stage
    tp_r = s % tp
    etp_r, ep_r = s % etp, (s // etp) % ep
    L = spec.num_layers
    if vpp > 1:
        n = L // (pp * vpp)
        layers = {c * n + j for c in range(stage, pp * vpp, pp) for j in range(n)}
    else:
        sizes = [L // pp] * pp
        if first is not None or last is not None:
            middle = pp - (first is not None) - (last is not None)
            rest = L - (first or 0) - (last or 0)
            sizes = [rest // middle if middle else 0] * pp
            if first is not None:
                sizes[0] = first
            if last is not None:
                sizes[-1] = last
        layers = set(range(sum(sizes[:stage]), sum(sizes[: stage + 1])))
    per_ep = spec.num_experts // ep
    my_experts = range(ep_r * per_ep, (ep_r + 1) * per_ep)
    vocab_rows = -(-spec.vocab_size // (128 * tp)) * 128  # Megatron pads the vocabulary to a multiple of 128*tp
    out = {}
    for name, shape in _hf_shapes(spec).items():
        mask = torch.zeros(shape, dtype=torch.bool)
        layer, expert = _layer_of(name), _expert_of(name)
        if name == "model.embed_tokens.weight":
            if stage == 0 or (spec.tie_word_embeddings and stage == pp - 1):
                mask[tp_r * vocab_rows:(tp_r + 1) * vocab_rows] = True
        elif name == "lm_head.weight":
            if stage == pp - 1:
                mask[tp_r * vocab_rows:(tp_r + 1) * vocab_rows] = True
        elif name == "model.norm.weight":
            mask[:] = stage == pp - 1
        elif layer not in layers:
            pass
        elif expert is not None:
            if expert in my_experts:
                n = spec.moe_ffn_hidden_size // etp
                _slice(mask, _kind(spec, name), etp_r * n, (etp_r + 1) * n)
        elif _kind(spec, name) == "whole":
            mask[:] = True
        else:
            n = shape[1 if _kind(spec, name) == "cols" else 0] // tp  # q heads, kv groups, ffn, shared ffn
            _slice(mask, _kind(spec, name), tp_r * n, (tp_r + 1) * n)
        out[name] = mask
    return out


def _needed(spec, infer_tp, j, infer_ep) -> dict[str, torch.Tensor]:
    G = spec.num_query_groups
    kv_shard = j // (infer_tp // G) if infer_tp >= G else j
    kv_per = 1 if infer_tp >= G else G // infer_tp
    if infer_ep:  # vLLM linear placement over ep = infer_tp ranks, whole experts
        base, rem = divmod(spec.num_experts, infer_tp)
        start = j * base + min(j, rem)
        my_experts, moe_tp, moe_r = range(start, start + base + (j < rem)), 1, 0
    else:
        my_experts, moe_tp, moe_r = range(spec.num_experts), infer_tp, j
    vocab_rows = -(-spec.vocab_size // 64) * 64 // infer_tp  # vLLM pads the vocabulary to a multiple of 64
    out = {}
    for name, shape in _hf_shapes(spec).items():
        mask = torch.zeros(shape, dtype=torch.bool)
        expert = _expert_of(name)
        kind = _kind(spec, name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            mask[j * vocab_rows:(j + 1) * vocab_rows] = True
        elif expert is not None:
            if expert in my_experts:
                n = spec.moe_ffn_hidden_size // moe_tp
                _slice(mask, kind, moe_r * n, (moe_r + 1) * n)
        elif kind == "whole":
            mask[:] = True
        elif ".k_proj." in name or ".v_proj." in name:
            n = kv_per * spec.head_dim
            mask[kv_shard * n:(kv_shard + 1) * n] = True
        else:
            n = shape[1 if kind == "cols" else 0] // infer_tp
            _slice(mask, kind, j * n, (j + 1) * n)
        out[name] = mask
    return out


def _independent_bound(spec, tp, pp, dp, ep, etp, vpp, first, last, infer_tp, infer_ep, dtype_bytes=2):
    out = {}
    for rank in range(tp * pp * dp):
        held = _held(spec, tp, pp, dp, ep, etp, vpp, first, last, rank)
        need = _needed(spec, infer_tp, rank % infer_tp, infer_ep)
        out[rank] = sum(int((need[n] & ~held[n]).sum()) for n in need) * dtype_bytes
    return out


def _cases():
    for name, spec in SPECS.items():
        for lay in LAYOUTS:
            tp, pp, dp, ep, etp, vpp, first, last, infer_tp, infer_ep = lay
            if ep > spec.num_experts or (infer_ep and infer_tp > spec.num_experts):
                continue
            yield pytest.param(spec, *lay, id=f"{name}-tp{tp}pp{pp}dp{dp}ep{ep}etp{etp}vpp{vpp}f{first}l{last}"
                                                 f"-infer{infer_tp}{'ep' if infer_ep else ''}")


@pytest.mark.parametrize("spec,tp,pp,dp,ep,etp,vpp,first,last,infer_tp,infer_ep", list(_cases()))
def test_moe_received_bytes_equal_the_independent_bound(spec, tp, pp, dp, ep, etp, vpp, first, last, infer_tp,
                                                        infer_ep):
    train = RoleTopology(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)  # etp as the config's parallel.etp makes it
    plan = plan_reshard(spec, train, infer_tp, dtype_bytes=2, train_layout=_train_layout(first, last, vpp),
                        infer_ep=infer_ep)
    bound = _independent_bound(spec, tp, pp, dp, ep, etp, vpp, first, last, infer_tp, infer_ep)
    assert {s.rank: s.bytes_received for s in plan.stats} == bound
    assert {s.rank: s.bytes_lower_bound for s in plan.stats} == bound  # the planner's own bound agrees
    assert sum(s.bytes_received for s in plan.stats) == sum(s.bytes_sent for s in plan.stats)
    # every op brings a rank only elements it needs (so no full expert lands on a rank that needs a slice) and
    # comes from a rank that holds them
    needs = {j: _needed(spec, infer_tp, j, infer_ep) for j in range(infer_tp)}
    helds = {r: _held(spec, tp, pp, dp, ep, etp, vpp, first, last, r) for r in train.ranks}
    for op in plan.ops:
        need, held = needs[op.dst % infer_tp][op.piece.hf_name], helds[op.src][op.piece.hf_name]
        idx = [slice(None)] * need.dim()
        idx[op.piece.dim] = slice(op.piece.start, op.piece.stop)
        assert bool(need[tuple(idx)].all()) and bool(held[tuple(idx)].all()), op


@pytest.mark.parametrize("infer_ep", [False, True], ids=["vllm-tp", "vllm-ep"])
@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_expert_slots_cover_exactly_the_experts_the_vllm_rank_holds(spec, infer_ep):
    """Per rank, the slots of vLLM's stacked w13/w2 are one expert each ([2*I/moe_tp, H] and [H, I/moe_tp]) and
    their number is vLLM's local expert count: the rank's shard of the stacked tensor and nothing more."""
    infer_tp = 2
    m, h = spec.moe_ffn_hidden_size, spec.hidden_size
    for j in range(infer_tp):
        shapes = vllm_param_shapes(spec, infer_tp, j, infer_ep)
        slots = {}
        for name, shape in shapes.items():
            slot = split_expert_slot(name)
            if slot is not None:
                slots.setdefault(slot[0], []).append((slot[1], shape))
        moe_layers = sum(spec.moe_layers)
        assert len(slots) == 2 * moe_layers
        local = spec.num_experts // infer_tp if infer_ep else spec.num_experts
        rows = m if infer_ep else m // infer_tp
        for base, entries in slots.items():
            assert sorted(e for e, _ in entries) == list(range(local))
            want = (2 * rows, h) if base.endswith("w13_weight") else (h, rows)
            assert {shape for _, shape in entries} == {want}, base


def test_vllm_ep_places_experts_linearly_with_the_remainder_first():
    # vllm fused_moe/expert_map_manager.py determine_expert_map: 8 experts over 3 ranks -> 3, 3, 2
    spec = MIXTRAL
    got = []
    for j in range(2):
        gates = [n.piece.hf_name for n in vllm_needs(spec, 2, j, infer_ep=True) if n.piece.hf_name.endswith("w1.weight")
                 and ".layers.0." in n.piece.hf_name]
        got.append([int(g.split(".experts.")[1].split(".")[0]) for g in gates])
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]
    from megarl.reshard.layouts import vllm_local_experts
    assert [list(vllm_local_experts(8, 3, r)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_theory_ep2_to_tp2_moves_half_of_the_other_ranks_experts():
    # Qwen3-MoE, EP2 over 2 ranks (tp=1): rank r holds everything dense whole and experts 2r, 2r+1 whole; vLLM TP2
    # rank r needs half of every expert and a part of the dense weights (all held locally). Per layer it receives
    # half of each of the 2 experts it lacks = one expert's worth of gate+up+down, in bf16.
    spec = QWEN3_MOE
    plan = plan_reshard(spec, RoleTopology(dp=2, ep=2), 2, dtype_bytes=2)
    per_expert = 3 * spec.moe_ffn_hidden_size * spec.hidden_size  # 6144 elements
    want = spec.num_layers * per_expert * 2
    assert [s.bytes_received for s in plan.stats] == [want, want]


def test_etp_and_vpp_are_validated():
    with pytest.raises(ValueError, match="etp\\*ep=4\\*2 must divide tp\\*cp\\*dp=4"):
        plan_reshard(QWEN3_MOE, RoleTopology(tp=2, dp=2, ep=2), 2, train_layout=TrainLayout(etp=4))
    with pytest.raises(ValueError, match="vpp > 1 with first_stage_layers"):
        TrainLayout(vpp=2, first_stage_layers=1)
    with pytest.raises(ValueError, match="does not split into pp\\*vpp=2\\*3"):
        plan_reshard(QWEN3_MOE, RoleTopology(pp=2), 1, train_layout=TrainLayout(vpp=3))
    with pytest.raises(ValueError, match="rollout.ep .* needs a mixture-of-experts model"):
        vllm_needs(ModelSpec(architecture="LlamaForCausalLM", num_layers=2, hidden_size=64, num_attention_heads=4,
                             num_query_groups=2, head_dim=16, ffn_hidden_size=128, vocab_size=300,
                             max_position_embeddings=128), 2, 0, infer_ep=True)


def test_local_expert_names_map_to_the_global_experts_the_rank_holds():
    # megatron-core SequentialMLP names a rank's experts local_experts.0..E/ep-1; EP rank 1 of 2 holds experts 2, 3
    from megarl.checkpoint.name_map import canonical_name
    from megarl.reshard.layouts import megatron_holdings

    local = [f"decoder.layers.0.mlp.experts.local_experts.{k}.linear_fc{j}.weight" for k in (0, 1) for j in (1, 2)]
    mapped = {canonical_name(n, 0, expert_offset=2) for n in local}
    held = {p.param for p in megatron_holdings(QWEN3_MOE, RoleTopology(dp=2, ep=2), 1)
            if ".layers.0.mlp.experts." in p.param}
    assert mapped == held == {f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc{j}.weight"
                              for e in (2, 3) for j in (1, 2)}


def test_vllm_sink_writes_expert_slots_into_one_stacked_tensor():
    """Slots `w13_weight[e]` land in the engine's stacked parameter, fed once when every local expert is written."""
    from types import SimpleNamespace

    from megarl.reshard.layouts import expert_slot_name
    from megarl.reshard.vllm_sink import VllmShardSink

    class Engine:  # the two calls the sink makes on a rollout engine, recorded
        def __init__(self):
            self.fed = []

        def param_shards(self):
            return [SimpleNamespace(name="m.w13_weight", dtype=torch.float32, shape=(2, 4, 3))]

        def update_weights(self, weights, layout):
            self.fed.append({n: t.clone() for n, t in weights})
            return len(self.fed[-1])

    engine = Engine()
    sink = VllmShardSink(engine)
    for e in (1, 0):  # any order
        slot = expert_slot_name("m.w13_weight", e)
        sink.target(slot, (4, 3), torch.float32).fill_(e + 1.0)
        assert not engine.fed
        sink.commit(slot)
    sink.finish()
    stacked = engine.fed[0]["m.w13_weight"]
    assert torch.equal(stacked, torch.stack([torch.full((4, 3), 1.0), torch.full((4, 3), 2.0)]))
    with pytest.raises(ValueError, match="does not fit the engine's m.w13_weight"):
        sink.target(expert_slot_name("m.w13_weight", 2), (4, 3), torch.float32)
