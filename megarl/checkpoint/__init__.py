"""HF <-> Megatron checkpoints.

  name_map    pure: HF <-> Megatron names, shapes and per-TP-rank layouts (`ParamLayout`, `shard_segments`,
              `build_shard`, `scatter_shard`, `hf_to_megatron_full`, `megatron_full_to_hf`) — shared with reshard
  hf_io       validated HF directory reader (slice reads) and streaming safetensors writer
  engine_io   HF weights straight into a live `MegatronEngine` (`load_hf_into_engine`, `build_engine_from_hf`),
              full-vocab logits out of one (`engine_logits`)
  dist_ckpt   Megatron distributed checkpoints: `save_engine_checkpoint`, `load_engine_checkpoint` (any layout),
              offline `hf_to_megatron`, `megatron_to_hf`
  verify      logit parity against transformers
  tiny        random HF models built with transformers (tests, benchmarks)
"""

import importlib

_EXPORTS = {
    "load_hf_into_engine": "engine_io", "build_engine_from_hf": "engine_io", "engine_logits": "engine_io",
    "save_engine_checkpoint": "dist_ckpt", "load_engine_checkpoint": "dist_ckpt",
    "hf_to_megatron": "dist_ckpt", "megatron_to_hf": "dist_ckpt", "CheckpointError": "errors",
}


def __getattr__(name):  # lazy: importing the package must not pull in megatron-core
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"megarl.checkpoint.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'megarl.checkpoint' has no attribute {name!r}")
