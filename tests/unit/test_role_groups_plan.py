"""The pure plan of every process group megatron-core needs for one role."""

from megarl.parallel.groups import plan_role_groups
from megarl.parallel.topology import RoleTopology


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
