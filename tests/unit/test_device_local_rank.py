"""LOCAL_RANK of a Ray GPU actor = position of its assigned GPU among the visible devices (issue 15 item 1).

Expected values are written from Ray's documented behaviour (it sets CUDA_VISIBLE_DEVICES to the actor's
`ray.get_gpu_ids()`) and vLLM 0.32's check (`local_rank < device_count()`), not from the function's code.
"""

import pytest

from megarl.controller.worker_group import device_local_rank


@pytest.mark.parametrize("bundle", [0, 1, 7])
def test_one_gpu_per_actor_is_device_zero_whatever_the_bundle(bundle):
    # Ray gave actor `bundle` physical GPU `bundle` and made it the only visible one: cuda:0 is that GPU.
    assert device_local_rank(bundle, [bundle], str(bundle)) == 0


def test_cpu_actor_keeps_the_bundle_index():
    assert device_local_rank(3, [], None) == 3
    assert device_local_rank(3, [], "0,1") == 3


def test_visible_list_position_not_physical_id():
    # Two GPUs (5 and 2) visible in Ray's order "5,2"; the actor's first assigned id is 2 -> index 1.
    assert device_local_rank(0, ["2", "5"], "5,2") == 1
    assert device_local_rank(4, [6], "4, 6") == 1


def test_unset_visible_devices_means_physical_index():
    assert device_local_rank(0, [3], None) == 3


def test_assigned_gpu_not_visible_is_a_named_error():
    with pytest.raises(ValueError, match=r"GPU 3 .*CUDA_VISIBLE_DEVICES='0,1'"):
        device_local_rank(0, [3], "0,1")
