"""RoleTopology: rank <-> coordinates in megatron-core's order (tp fastest, then cp, dp, pp), group enumeration."""

import pytest

from megarl.parallel.topology import RoleTopology, TopologyError, layer_split


def test_rank_order_matches_megatron_tp_cp_dp_pp():
    topo = RoleTopology(tp=2, cp=1, dp=2, pp=2)
    coords = [(c.tp, c.dp, c.pp) for c in topo.coords()]
    assert coords == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]


def test_rank_of_inverts_coord_with_offset():
    topo = RoleTopology(tp=2, cp=2, dp=3, pp=2, rank_offset=5)
    for c in topo.coords():
        assert topo.rank_of(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == c.rank
    assert list(topo.ranks) == list(range(5, 5 + 24))


def test_groups_enumerate_like_megatron():
    topo = RoleTopology(tp=2, dp=2, pp=2)
    assert topo.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.groups(("tp", "pp")) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_embedding_group_is_first_and_last_stage():
    topo = RoleTopology(pp=4)
    assert topo.embedding_group([0, 1, 2, 3]) == [0, 3]
    assert RoleTopology().embedding_group([7]) == [7]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(tp=0), "tp must be a positive integer, got 0"),
        (dict(dp=3, ep=2), "ep=2 must divide dp*cp=3*1=3"),
        (dict(rank_offset=-1), "rank_offset must be >= 0, got -1"),
    ],
)
def test_invalid_layouts_name_the_numbers(kwargs, message):
    with pytest.raises(TopologyError, match=message.replace("*", r"\*")):
        RoleTopology(**kwargs)


def test_coord_outside_role_is_an_error():
    with pytest.raises(TopologyError, match="rank 4 is outside this role's ranks 0..3"):
        RoleTopology(tp=2, dp=2).coord(4)


def test_layer_split_even_and_uneven():
    assert layer_split(8, 2) == [4, 4]
    assert layer_split(10, 4, first_stage_layers=1, last_stage_layers=3) == [1, 3, 3, 3]
    with pytest.raises(TopologyError, match="num_layers=10 is not divisible by pp=4"):
        layer_split(10, 4)
    with pytest.raises(TopologyError, match="do not divide evenly over 2 middle stage"):
        layer_split(10, 4, first_stage_layers=1, last_stage_layers=2)
