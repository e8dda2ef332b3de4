"""Sleep/wake probe on one GPU (issue 15): the phase order the hybrid worker uses frees memory, keeps greedy
generations, and lets new weights be written between `wake(("weights",))` and `wake(("kv_cache",))`.

Reference for the greedy tokens: transformers' own generate on the same HF directory (`hf_greedy`). Run with `-s`
to see the measured numbers (benchmarks/gpu_check.sh does).
"""

import pytest

pytestmark = pytest.mark.gpu


def test_sleep_level2_frees_memory_and_weights_reload_between_wakes(tmp_path):
    import os

    import torch
    from safetensors.torch import load_file

    from megarl.rollout.engine import SamplingSettings
    from megarl.rollout.testing import build_tiny_llama, hf_greedy
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    prompts, new = [[1, 5, 9, 12], [1, 7, 3]], 8
    hf_a = build_tiny_llama(str(tmp_path / "a"), seed=3)
    hf_b = build_tiny_llama(str(tmp_path / "b"), seed=4)
    want_a, want_b = hf_greedy(hf_a, prompts, new), hf_greedy(hf_b, prompts, new)
    assert want_a != want_b, "the two tiny models must generate differently for the probe to mean anything"
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    engine = VllmRolloutEngine(VllmEngineSettings(model_path=hf_a, dtype="float32", max_model_len=64,
                                                  max_prompt_tokens=32, gpu_memory_utilization=0.3))
    ids = lambda: [s.response_ids for s in engine.generate(prompts, greedy)]  # noqa: E731
    assert ids() == want_a

    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(level=2)
    torch.cuda.synchronize()
    free_asleep = torch.cuda.mem_get_info()[0]
    freed = free_asleep - free_awake
    print(f"sleep(level=2) freed {freed / 2**20:.1f} MiB (free {free_awake / 2**30:.2f} -> "
          f"{free_asleep / 2**30:.2f} GiB)")
    assert freed > 0.2 * 0.3 * torch.cuda.mem_get_info()[1], "sleep(level=2) freed less than a fifth of the pool"

    engine.wake(("weights",))
    n = engine.update_weights(iter(load_file(os.path.join(hf_b, "model.safetensors")).items()), layout="hf")
    engine.wake(("kv_cache",))
    got_b = ids()
    print(f"reloaded {n} tensors between wake(weights) and wake(kv_cache); greedy == transformers(b): "
          f"{got_b == want_b}")
    assert got_b == want_b

    engine.sleep(level=1)  # level 1 keeps the weights on the host: greedy unchanged after a full wake
    engine.wake()
    assert ids() == want_b
    assert [e[0] for e in engine.events].count("sleep") == 2
    engine.close()
