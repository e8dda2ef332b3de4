"""The pure plan of every process group megatron-core needs for one role."""

import pytest

from megarl.parallel.groups import plan_role_groups
from megarl.parallel.topology import RoleTopology, TopologyError


def test_dense_tp2_pp2_plan():
    plan = plan_role_groups(RoleTopology(tp=2, pp=2))
    assert plan["tp"] == [[0, 1], [2, 3]]
    assert plan["pp"] == [[0, 2], [1, 3]]
    assert plan["mp"] == [[0, 1, 2, 3]]
    assert plan["embd"] == [[0, 2], [1, 3]]  # first + last stage share tied embeddings
    assert plan["pos_embd"] == [[0], [1]]
    assert plan["dp"] == [[0], [1], [2], [3]]
    assert plan["intra_dist_opt"] == [[0, 1, 2, 3]]  # grad-norm reduction spans the whole role
    # dense model: expert groups degenerate to the dense ones
    assert plan["expt_tp"] == plan["tp"] and plan["expt_dp"] == plan["dp_cp"]


def test_offset_role_only_uses_its_ranks():
    plan = plan_role_groups(RoleTopology(dp=2, rank_offset=2))
    assert plan["dp"] == [[2, 3]]
    assert plan["tp"] == [[2], [3]]
    assert plan["intra_dist_opt"] == [[2, 3]]


def test_expert_parallel_carved_from_data_parallel():
    plan = plan_role_groups(RoleTopology(tp=1, dp=4, ep=2))
    assert plan["ep"] == [[0, 1], [2, 3]]
    assert plan["expt_dp"] == [[0, 2], [1, 3]]


# (tp, cp, dp, pp, ep, etp): expert TP equal to, below and above the dense TP; EP spanning TP ranks
EXPERT_LAYOUTS = [
    (2, 1, 2, 1, 2, None), (2, 1, 2, 1, 2, 1), (2, 1, 1, 1, 2, 1), (1, 1, 2, 1, 1, 2), (1, 1, 4, 1, 2, 2),
    (2, 1, 2, 2, 2, 1), (4, 1, 2, 1, 4, 2), (2, 2, 2, 1, 4, 1), (2, 1, 4, 2, 2, 4),
]


@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp", EXPERT_LAYOUTS)
def test_expert_groups_equal_megatron_cores_rank_generator(tp, cp, dp, pp, ep, etp):
    """The expert groups are the ones megatron-core's `initialize_model_parallel` builds: its own expert
    `RankGenerator` (order tp-cp-ep-dp-pp with tp := etp, cp := 1, dp := world / (etp*ep*pp)) is the reference."""
    from megatron.core.parallel_state import RankGenerator

    topo = RoleTopology(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp)
    etp = etp or tp
    world = tp * cp * dp * pp
    gen = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    plan = plan_role_groups(topo)
    for ours, theirs in (("ep", "ep"), ("expt_tp", "tp"), ("expt_dp", "dp"), ("tp_ep", "tp-ep"),
                         ("tp_ep_pp", "tp-ep-pp")):
        assert sorted(plan[ours]) == sorted(gen.get_ranks(theirs)), ours
    # and the dense pipeline groups are the expert grid's (megatron-core asserts this)
    assert sorted(plan["pp"]) == sorted(gen.get_ranks("pp"))


def test_expert_coordinates_of_tp2_ep2_etp1():
    """tp=2, dp=2, ep=2, etp=1 (hand-derived from the etp-ep-edp order): ranks 0, 2 are EP rank 0 and ranks 1, 3
    EP rank 1 (EP spans the TP pair), each expert whole (etp rank 0), expert-DP pairs {0, 2} and {1, 3}."""
    topo = RoleTopology(tp=2, dp=2, ep=2, etp=1)
    assert [(c.etp, c.ep, c.edp) for c in map(topo.expert_coord, topo.ranks)] == [(0, 0, 0), (0, 1, 0), (0, 0, 1),
                                                                                  (0, 1, 1)]
    assert topo.expert_dp == 2


def test_expert_grid_is_validated_with_the_numbers():
    with pytest.raises(TopologyError, match=r"etp\*ep=1\*4=4 must divide tp\*cp\*dp=2\*1\*1=2"):
        RoleTopology(tp=2, ep=4, etp=1)
    with pytest.raises(TopologyError, match="ep=2 must divide dp\\*cp=1\\*1=1"):
        RoleTopology(tp=2, ep=2)
    assert RoleTopology(tp=2, ep=2, etp=1).expert_dp == 1  # EP over the TP pair: allowed when etp=1
    assert RoleTopology(tp=2, etp=2) == RoleTopology(tp=2)  # etp = tp has one spelling
