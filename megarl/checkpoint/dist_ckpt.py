"""Megatron distributed checkpoints (megatron-core `dist_checkpointing`, torch_dist format) for megarl models.

A checkpoint directory holds megatron-core's files (`metadata.json`, `common.pt`, `__*.distcp`) plus
`megarl_checkpoint.json` (the HF `config.json` the model came from, the dtype) and `hf_assets/`
(generation config and tokenizer files), so it converts back to a complete HF directory. A trained role's
checkpoint saved `with_optimizer` adds the distributed optimizer's state (keys `optimizer.state.<kind>.<model key>`,
sharded like the weights: `megarl.checkpoint.train_state`) and `engine_state.pt` (param groups, LR scheduler,
step counter).

Layout independence: keys and global shapes are megatron-core's own (layers stacked on a leading axis, fc1 as
[gate; up]) except the word embedding and output layer, which are stored with the *real* vocabulary rows only
(global shape [vocab, hidden], uneven TP chunks): megatron pads the vocabulary to a multiple of 128*tp, so its
padded global shape depends on TP and would not load at another TP.

megatron-core 0.16.1 workaround: layers that fall back to megatron's global parallel state (any call path
that passes a dp_cp group but no tp group) give replicated tensors such as the norm weights replica_id
(0, 0, 0) on every TP rank, and `save` fails with "Invalid access pattern". `assign_replica_ids` recomputes
every ShardedTensor's replica_id from what all ranks actually hold: exactly one main replica per chunk.

Every function here that touches a checkpoint is collective over the *whole* torch.distributed world (that is
what megatron-core's save/load are): ranks outside the role pass `engine=None` and contribute nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from megarl.checkpoint.atomic import check_output_dir, commit_dir, make_temp_dir, temp_dir_for
from megarl.checkpoint.engine_io import check_same_model, refresh_optimizer_copies
from megarl.checkpoint.errors import CheckpointError
from megarl.checkpoint.hf_io import HFReader, HFWriter, spec_from_hf_config
from megarl.checkpoint.name_map import (
    DIST_CKPT_NAMES,
    LAYER_RE,
    ParamLayout,
    hf_shapes,
    hf_to_megatron_full,
    megatron_full_to_hf,
    param_layouts,
    shard_segments,
)
from megarl.engine.lora import engine_lora_settings, is_lora_param
from megarl.models.gpt import DTYPES
from megarl.models.spec import ARCHITECTURES, ModelSpec, moe_hf_config_fields
from megarl.platform.distributed import named_barrier
from megarl.platform.megatron_cpu_compat import megatron_on_cpu

META_NAME = "megarl_checkpoint.json"
ASSETS_DIR = "hf_assets"
FORMAT = "megarl-megatron-v1"
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
ENGINE_STATE = "engine_state.pt"  # optimizer param groups, LR scheduler, step counter (`train_state.common_state`)
OPTIMIZER_SD_KEY = "optimizer"  # where the optimizer's ShardedTensors sit in the sharded state dict


# ----------------------------------------------------------------------------------------------- replica ids
def plan_replica_ids(chunks_per_rank: list[list[tuple]]) -> list[list[int]]:
    """Pure: given, per rank, the chunks it holds ((key, global_offset, local_shape) tuples, in order), return
    per rank a replica id per chunk: 0 for the lowest rank holding that chunk, 1, 2, ... for the other holders."""
    seen: dict[tuple, int] = {}
    out = []
    for chunks in chunks_per_rank:
        ids = []
        for c in chunks:
            ids.append(seen.get(c, 0))
            seen[c] = seen.get(c, 0) + 1
        out.append(ids)
    return out


def assign_replica_ids(sharded_sd: dict) -> None:
    """Collective over the world: set each ShardedTensor's replica_id so every chunk has one main replica.

    Apply factories first (`_prepared`): a factory's tensors only exist once built."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tensors = [v for v in nested_values(sharded_sd) if isinstance(v, ShardedTensor)]
    mine = [(t.key, tuple(t.global_offset), tuple(t.local_shape)) for t in tensors]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    ids = plan_replica_ids(everyone)[dist.get_rank()]
    for t, rid in zip(tensors, ids):
        t.replica_id = rid


# ----------------------------------------------------------------------------------------------- engine side
def module_sharded_state_dict(engine) -> dict:
    """This rank's megatron-core sharded state dict of the model as megatron-core builds it (padded vocabulary;
    each ShardedTensor's `data` is the parameter itself, which is how the optimizer's state is matched to it).

    With virtual pipeline chunks (`engine.vpp > 1`) the chunks' dicts are merged with their keys prefixed by the
    chunk index ("0.decoder...", as `engine.module.named_parameters()` names them): megatron-core gives each chunk's
    layers their global offsets (`vp_stage`), so the ShardedTensors' own keys and shapes are layout-independent."""
    if engine.vpp == 1:
        return _chunk_sharded_state_dict(engine, engine.chunks[0])
    return {f"{c}.{k}": v for c, chunk in enumerate(engine.chunks)
            for k, v in _chunk_sharded_state_dict(engine, chunk).items()}


def _local_name(engine, name: str) -> str:
    """A `module_sharded_state_dict` / `engine.module` parameter name without its chunk prefix (vpp > 1)."""
    return name.split(".", 1)[1] if engine.vpp > 1 else name


def _chunk_sharded_state_dict(engine, module) -> dict:
    # megatron-core 0.16.1 ties a last stage's output layer to the first stage's embedding through the global
    # parallel state (LanguageModule.tie_embeddings_and_output_weights_state_dict reads
    # parallel_state.get_data_parallel_rank), which megarl never initialises. Build that entry untied and key it
    # as the embedding (`_vocab_entry`); `assign_replica_ids` then makes it a non-main replica of the first stage's.
    retie = engine.spec.tie_word_embeddings and module.post_process and not module.pre_process
    if retie:
        module.share_embeddings_and_output_weights = False
    try:
        return module.sharded_state_dict(metadata={"dp_cp_group": engine.groups.pgs.dp_cp})
    finally:
        if retie:
            module.share_embeddings_and_output_weights = True


def engine_sharded_state_dict(engine, raw: Optional[dict] = None) -> dict:
    """This rank's megatron-core sharded state dict in megarl's layout-independent form (see module doc).
    `raw`: `module_sharded_state_dict(engine)` when the caller already built it."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd = module_sharded_state_dict(engine) if raw is None else raw
    adapters_only = engine_lora_settings(engine) is not None  # LoRA: the frozen base stays in its HF directory
    out = {}
    for name, item in sd.items():
        if isinstance(item, ShardedObject) or name.endswith("_extra_state"):
            continue  # local-spec / bf16 extra state is None; TE fp8 scaling state is not carried over
        if adapters_only and not is_lora_param(name):
            continue
        if _local_name(engine, name) in VOCAB_KEYS:
            entry = _vocab_entry(engine, item, VOCAB_KEYS[0] if engine.spec.tie_word_embeddings else item.key)
            if entry is not None:  # None: this TP rank holds padding rows only
                out[name] = entry
            continue
        out[name] = item
    return out


def _vocab_entry(engine, item, key: str):
    """`item` (a [padded vocab shard, hidden] ShardedTensor) cut to its real vocabulary rows, as a chunk of the
    [vocab, hidden] tensor `key`; None when this TP rank holds padding rows only."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    spec, topo, coord = engine.spec, engine.groups.topology, engine.groups.coord
    segs = shard_segments(spec, _vocab_layout(spec), coord.tp, topo.tp, pad_vocab=False)
    if not segs:
        return None
    seg = segs[0]
    data = item.data[: seg.size]
    return ShardedTensor(
        key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
        global_shape=(spec.vocab_size, spec.hidden_size), global_offset=(seg.start, 0),
        axis_fragmentations=None, replica_id=item.replica_id,
    )


def optimizer_state_entries(engine, raw: dict, is_loading: bool) -> tuple[dict, list]:
    """The optimizer's sharded state (`train_state.optimizer_sharded_state`) in the same layout-independent form
    as the weights: Adam's tensors of the embedding / output layer cut to the real vocabulary rows.

    Returns (entries, vocab): entries {sub-optimizer: {param index: {kind: ShardedTensor or factory}}} (kinds
    exp_avg, exp_avg_sq, and param, the fp32 main copy, for bf16/fp16 weights only); vocab
    lists (sub-optimizer, index, kind, padded shape) for every vocabulary tensor, whose loaded rows
    `pad_vocab_rows` puts back at the padded shape."""
    from megarl.checkpoint.train_state import OPTIMIZER_KEY, optimizer_sharded_state

    entries = optimizer_sharded_state(engine, raw, is_loading)
    vocab = []
    for sub, per_param in entries.items():
        for idx, tensors in per_param.items():
            if engine.dtype == "fp32":
                # fp32: the optimizer's main parameters are views of the model's (megatron-core's distributed
                # optimizer keeps a separate fp32 copy only for bf16/fp16 weights): the weights already hold them.
                tensors.pop("param", None)
            for kind in list(tensors):
                item = tensors[kind]
                model_key = item.key[len(f"{OPTIMIZER_KEY}{kind}."):]
                if model_key not in VOCAB_KEYS:
                    continue
                vocab.append((sub, idx, kind, tuple(item.data.shape)))
                key = f"{OPTIMIZER_KEY}{kind}.{VOCAB_KEYS[0] if engine.spec.tie_word_embeddings else model_key}"
                entry = _vocab_entry(engine, item, key)
                if entry is None:
                    del tensors[kind]
                else:
                    tensors[kind] = entry
    return entries, vocab


def pad_vocab_rows(loaded: dict, vocab: list) -> None:
    """Put the loaded real-vocabulary rows of the optimizer's vocabulary tensors back at their padded shape (the
    padding rows' state is zero: they never receive a gradient)."""
    for sub, idx, kind, shape in vocab:
        full = torch.zeros(shape, dtype=torch.float32)
        got = loaded[sub][idx].get(kind)
        if got is not None:
            full[: got.shape[0]].copy_(got)
        loaded[sub][idx][kind] = full


def _prepared(sd: dict) -> dict:
    """Build factories (fc1's [gate; up] split) in place, fix replica ids world-wide; returns the factories,
    which `apply_factory_merges` needs to merge loaded pieces back. Collective over the world."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory, apply_factories

    factories, _ = extract_matching_values(
        sd, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sd)
    assign_replica_ids(sd)
    return factories


def _vocab_layout(spec: ModelSpec) -> ParamLayout:
    return param_layouts(spec)[0]


def _broadcast_error(msg: Optional[str]) -> None:
    """Rank 0's check result to every rank; all raise together so no rank waits in a collective."""
    box = [msg]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise CheckpointError(box[0])


def _rank0_token() -> int:
    box = [os.getpid()]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_engine_checkpoint(engine, out: str, overwrite: bool = False, hf_config: Optional[dict] = None,
                           assets: tuple[str, ...] = (), hf_dir: Optional[str] = None,
                           with_optimizer: bool = False) -> None:
    """Collective over the world: save `engine` (None on ranks outside the role) to `out`, atomically.

    `hf_dir` (the directory the model came from) supplies the HF config and tokenizer files that
    `megatron_to_hf` writes back; without it `hf_config`/`assets` are used, or a config built from the spec.
    `with_optimizer` (same on every rank; a frozen role has nothing to add): also the distributed optimizer's
    state, resharded like the weights (`megarl.checkpoint.train_state`), and `ENGINE_STATE` (param groups,
    scheduler, step counter).
    """
    from megatron.core import dist_checkpointing

    from megarl.checkpoint.train_state import common_state, merge_common_states

    if hf_dir is not None and dist.get_rank() == 0:
        reader = HFReader(hf_dir)
        hf_config, assets = hf_config or reader.config, tuple(assets) or tuple(reader.asset_files())

    err = None
    if dist.get_rank() == 0:
        try:
            check_output_dir(out, overwrite)
            make_temp_dir(out, os.getpid())
        except CheckpointError as e:
            err = str(e)
    _broadcast_error(err)
    tmp = temp_dir_for(out, _rank0_token())
    trained = with_optimizer and engine is not None and engine.trainable
    with megatron_on_cpu():
        sd = {}
        if engine is not None:
            raw = module_sharded_state_dict(engine)
            sd = engine_sharded_state_dict(engine, raw)
            if trained:
                sd[OPTIMIZER_SD_KEY], _ = optimizer_state_entries(engine, raw, is_loading=False)
        _prepared(sd)
        dist_checkpointing.save(sd, tmp)
    infos: list[Any] = [None] * dist.get_world_size()
    lora = engine_lora_settings(engine) if engine is not None else None
    mine = (engine.dtype, common_state(engine) if trained else None,
            dataclasses.asdict(lora) if lora is not None else None) if engine is not None else None
    dist.all_gather_object(infos, mine)
    if dist.get_rank() == 0:
        if hf_config is None:
            src = engine.spec if engine is not None else None
            if src is None:
                raise CheckpointError("save_engine_checkpoint: rank 0 must be in the role or pass hf_config")
            hf_config = spec_to_hf_config(src)
        dtype = next(i[0] for i in infos if i)
        lora = next((i[2] for i in infos if i), None)
        extra = {} if lora is None else {"lora": lora, "base_model": os.path.abspath(hf_dir) if hf_dir else None}
        _write_meta(tmp, hf_config, dtype, assets, extra)
        common = merge_common_states([i[1] for i in infos if i])
        if common is not None:
            torch.save(common, os.path.join(tmp, ENGINE_STATE))
        commit_dir(tmp, out)
    named_barrier(f"rank 0 to commit the checkpoint {out}")


def has_optimizer_state(mdir: str) -> bool:
    """Whether the checkpoint at `mdir` holds optimizer state (saved with `with_optimizer=True`)."""
    return os.path.isfile(os.path.join(mdir, ENGINE_STATE))


def load_engine_checkpoint(engine, mdir: str, with_optimizer: bool = False) -> None:
    """Collective over the world: load the checkpoint at `mdir` into `engine` (None outside the role), in place.

    `with_optimizer` (same on every rank): also restore a trainable engine's optimizer, scheduler and step counter
    (at any TP/PP/DP layout); the checkpoint must have been saved with them, else `CheckpointError`."""
    from megatron.core import dist_checkpointing

    from megarl.checkpoint.train_state import load_common_and_params

    err = None
    if dist.get_rank() == 0:
        try:
            read_meta(mdir)
            if with_optimizer and not has_optimizer_state(mdir):
                raise CheckpointError(f"{mdir} holds model weights only (no {ENGINE_STATE}: saved without optimizer "
                                      "state, e.g. by an older megarl or checkpoint_tools/hf_to_megatron.py); load "
                                      "it without the optimizer, whose moments then restart")
        except CheckpointError as e:
            err = str(e)
    _broadcast_error(err)
    adapters_only = False
    if engine is not None:
        meta = read_meta(mdir)
        check_same_model(engine.spec, spec_from_hf_config(meta["hf_config"]))
        lora = engine_lora_settings(engine)
        adapters_only = lora is not None
        saved = meta.get("lora")
        if adapters_only != (saved is not None) or (saved and saved["rank"] != lora.rank) or \
                (saved and tuple(saved["targets"]) != tuple(lora.targets)):
            raise CheckpointError(f"{mdir} holds {'LoRA adapters ' + str(saved) if saved else 'a full model'} but "
                                  f"the engine is built with {'LoRA ' + str(lora) if lora else 'no LoRA'}: set "
                                  "actor.lora as when the checkpoint was saved")
    trained = with_optimizer and engine is not None and engine.trainable
    with megatron_on_cpu():
        from megatron.core.dist_checkpointing.mapping import apply_factory_merges

        sd, vocab = {}, []
        if engine is not None:
            raw = module_sharded_state_dict(engine)
            sd = engine_sharded_state_dict(engine, raw)
            if trained:
                sd[OPTIMIZER_SD_KEY], vocab = optimizer_state_entries(engine, raw, is_loading=True)
        factories = _prepared(sd)
        try:
            # No world-wide access validation on load: roles at different layouts may load in one call (their
            # chunk shapes differ, which megatron-core's check rejects); DCP still fails on any missing chunk.
            loaded = dist_checkpointing.load(sd, mdir, validate_access_integrity=False)
        except Exception as e:  # DCP wraps reader errors in its own exception types
            raise CheckpointError(f"cannot load {mdir}: {_first_line(e)}") from None
        loaded = apply_factory_merges(loaded, factories)
    if engine is None:
        return
    with torch.no_grad():
        params = dict(engine.module.named_parameters())
        for name, param in params.items():
            if adapters_only and not is_lora_param(name):
                continue  # the frozen base: loaded from its HF directory when the engine was built
            if _local_name(engine, name) in VOCAB_KEYS:
                t = loaded.get(name)
                n = 0 if t is None else t.shape[0]
                if t is not None:
                    param.data[:n].copy_(t)
                param.data[n:].zero_()
                continue
            if name not in loaded:
                raise CheckpointError(f"checkpoint {mdir} did not provide {name}")
            param.data.copy_(loaded[name])
    refresh_optimizer_copies(engine)
    if trained:
        opt_state = loaded[OPTIMIZER_SD_KEY]
        pad_vocab_rows(opt_state, vocab)
        with megatron_on_cpu():
            load_common_and_params(engine, torch.load(os.path.join(mdir, ENGINE_STATE), weights_only=True),
                                   opt_state)


# ----------------------------------------------------------------------------------------------- metadata
def spec_to_hf_config(spec: ModelSpec) -> dict:
    """A minimal HF `config.json` for `spec` (used when a checkpoint was not converted from an HF directory)."""
    traits = ARCHITECTURES[spec.architecture]
    cfg = dict(
        architectures=[spec.architecture], model_type=traits.model_type, num_hidden_layers=spec.num_layers,
        hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups, head_dim=spec.head_dim, intermediate_size=spec.ffn_hidden_size,
        vocab_size=spec.vocab_size, max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta, rms_norm_eps=spec.norm_eps, tie_word_embeddings=spec.tie_word_embeddings,
        hidden_act="silu",
    )
    if spec.rope_scaling:
        cfg["rope_scaling"] = dict(spec.rope_scaling)
    if traits.attention_bias_key:
        cfg["attention_bias"] = spec.qkv_bias
    cfg.update(moe_hf_config_fields(spec))
    return cfg


def _write_meta(tmp: str, hf_config: dict, dtype: str, assets, extra: Optional[dict] = None) -> None:
    """`extra`: with LoRA, {"lora": LoraSettings as a dict, "base_model": the base's HF directory}."""
    with open(os.path.join(tmp, META_NAME), "w") as f:
        json.dump({"format": FORMAT, "dtype": dtype, "hf_config": hf_config, **(extra or {})}, f, indent=2,
                  sort_keys=True)
    if assets:
        os.makedirs(os.path.join(tmp, ASSETS_DIR), exist_ok=True)
        for path in assets:
            shutil.copy2(path, os.path.join(tmp, ASSETS_DIR, os.path.basename(path)))


def read_meta(mdir: str) -> dict:
    if not os.path.isdir(mdir):
        raise CheckpointError(f"Megatron checkpoint directory {mdir} does not exist")
    for need in ("metadata.json", META_NAME):
        if not os.path.isfile(os.path.join(mdir, need)):
            raise CheckpointError(f"{mdir} is not a megarl Megatron checkpoint: {need} is missing")
    try:
        with open(os.path.join(mdir, META_NAME)) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{os.path.join(mdir, META_NAME)} is not valid JSON: {e.msg}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{mdir}: unknown checkpoint format {meta.get('format')!r}, expected {FORMAT}")
    return meta


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


# ----------------------------------------------------------------------------------------------- offline
def _moe_dist_ckpt_key(layout: ParamLayout) -> str:
    """Key of a MoE model's layer tensor in a megatron-core distributed checkpoint.

    megatron-core 0.16.1 (`TransformerBlock.sharded_state_dict`) keys every layer separately ("non-homogeneous
    layers": `decoder.layers.{i}.…`, no stacked layer axis) when `moe_layer_freq` is a list, which megarl always
    passes for MoE models; routed experts of a layer share one key `decoder.layers.{i}.mlp.experts.experts.linear_fc1
    .weight` with the global expert index as a leading axis (`SequentialMLP.sharded_state_dict`)."""
    m = LAYER_RE.match(layout.megatron_name)
    suffix = m.group(2)
    if layout.expert is not None:
        suffix = "mlp.experts.experts." + suffix.rsplit(".", 2)[-2] + ".weight"
    return f"decoder.layers.{layout.layer}." + DIST_CKPT_NAMES.get(suffix, suffix)


def _full_sharded_tensor(spec: ModelSpec, layout: ParamLayout, data: torch.Tensor, regular_grid: bool = True):
    """The ShardedTensor that holds a whole (TP=1, real-vocab) Megatron tensor, keyed as megatron-core keys it."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if layout.layer is None:
        return ShardedTensor.from_rank_offsets(layout.dist_ckpt_key, data, replica_id=0)
    if spec.is_moe:
        key = _moe_dist_ckpt_key(layout)
        if layout.expert is None:
            return ShardedTensor.from_rank_offsets(key, data, replica_id=0)
        if regular_grid:
            return ShardedTensor.from_rank_offsets(
                key, data, (0, layout.expert, spec.num_experts), replica_id=0, prepend_axis_num=1
            )
        data = data.unsqueeze(0)  # one expert as an irregular chunk (see below)
        return ShardedTensor(
            key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
            global_shape=(spec.num_experts,) + tuple(data.shape[1:]),
            global_offset=(layout.expert,) + (0,) * (data.dim() - 1), axis_fragmentations=None, replica_id=0,
        )
    if not regular_grid:
        # One layer of the stacked tensor, as an irregular chunk: megatron-core builds a regular grid's torch
        # metadata as if this rank held every layer, and DCP then refuses a read of a single layer.
        data = data.unsqueeze(0)
        return ShardedTensor(
            key=layout.dist_ckpt_key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
            global_shape=(spec.num_layers,) + tuple(data.shape[1:]),
            global_offset=(layout.layer,) + (0,) * (data.dim() - 1),
            axis_fragmentations=None, replica_id=0,
        )
    return ShardedTensor.from_rank_offsets(
        layout.dist_ckpt_key, data, (0, layout.layer, spec.num_layers), replica_id=0, prepend_axis_num=1
    )


def hf_to_megatron(hf_dir: str, out: str, dtype: Optional[str] = None, overwrite: bool = False) -> dict:
    """Collective over the world: convert the HF directory to a Megatron distributed checkpoint at `out`.

    Rank 0 streams the HF tensors one at a time into Megatron layout (peak memory: one copy of the model in the
    target dtype plus one tensor); other ranks take part in megatron-core's collective save with nothing.
    Returns {"params": n, "bytes": b} on rank 0.
    """
    from megatron.core import dist_checkpointing

    err, reader = None, None
    if dist.get_rank() == 0:
        try:
            reader = HFReader(hf_dir)
            check_output_dir(out, overwrite)
            if dtype is not None and dtype not in DTYPES:
                raise CheckpointError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
            make_temp_dir(out, os.getpid())
        except CheckpointError as e:
            err = str(e)
    _broadcast_error(err)
    tmp = temp_dir_for(out, _rank0_token())
    sd, stats = {}, {"params": 0, "bytes": 0}
    if reader is not None:
        spec = reader.spec
        torch_dtype = DTYPES[dtype] if dtype else reader.dtype
        for layout in param_layouts(spec):
            hf = {n: reader.read(n) for n in layout.hf_names}
            full = hf_to_megatron_full(spec, layout, hf).to(torch_dtype).contiguous()
            del hf
            sd[layout.megatron_name] = _full_sharded_tensor(spec, layout, full)
            stats["params"] += full.numel()
            stats["bytes"] += full.numel() * full.element_size()
    try:
        with megatron_on_cpu():
            dist_checkpointing.save(sd, tmp)
    except Exception:
        if reader is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if reader is not None:
        name = {v: k for k, v in DTYPES.items()}[torch_dtype]
        _write_meta(tmp, reader.config, name, reader.asset_files())
        commit_dir(tmp, out)
    named_barrier(f"rank 0 to commit the converted checkpoint {out}")
    return stats


def read_steps(spec: ModelSpec, dtype: torch.dtype, max_step_bytes: int) -> list[list[ParamLayout]]:
    """The order `megatron_to_hf` reads tensors in: embedding/final norm/output first, then layer by layer; a
    MoE layer's routed experts in runs of whole experts of at most `max_step_bytes` (at least one expert)."""
    steps: dict[Optional[int], list[ParamLayout]] = {}
    experts: dict[int, dict[int, list[ParamLayout]]] = {}
    for lay in param_layouts(spec):
        if lay.expert is None:
            steps.setdefault(lay.layer, []).append(lay)
        else:
            experts.setdefault(lay.layer, {}).setdefault(lay.expert, []).append(lay)
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = []
    for layer in [None] + list(range(spec.num_layers)):
        out.append(steps[layer])
        run, run_bytes = [], 0
        for lays in experts.get(layer, {}).values():
            nbytes = sum(math.prod(_full_shape(spec, lay)) * itemsize for lay in lays)
            if run and run_bytes + nbytes > max_step_bytes:
                out.append(run)
                run, run_bytes = [], 0
            run.extend(lays)
            run_bytes += nbytes
        if run:
            out.append(run)
    return out


def megatron_to_hf(mdir: str, out: str, overwrite: bool = False, max_shard_bytes: int = 2 * 1024**3,
                   max_step_bytes: int = 1024**3) -> dict:
    """Collective over the world: write the Megatron checkpoint at `mdir` as an HF directory at `out`.

    Reads one layer at a time, a MoE layer's routed experts in runs of at most `max_step_bytes` (peak memory: one
    dense layer or expert run plus one safetensors shard being written). The HF
    config, generation config and tokenizer files come from the checkpoint's `hf_assets/`.
    """
    from megatron.core import dist_checkpointing

    err, meta, writer = None, None, None
    if dist.get_rank() == 0:
        try:
            meta = read_meta(mdir)
            writer = HFWriter(out, overwrite=overwrite, max_shard_bytes=max_shard_bytes)
        except CheckpointError as e:
            err = str(e)
    _broadcast_error(err)
    meta = read_meta(mdir)
    spec = spec_from_hf_config(meta["hf_config"])
    dtype = DTYPES[meta["dtype"]]
    try:
        for step in read_steps(spec, dtype, max_step_bytes):
            sd = {}
            if writer is not None:
                for lay in step:
                    shape = _full_shape(spec, lay)
                    sd[lay.megatron_name] = _full_sharded_tensor(
                        spec, lay, torch.empty(shape, dtype=dtype), regular_grid=False
                    )
            with megatron_on_cpu():
                try:
                    loaded = dist_checkpointing.load(sd, mdir, validate_access_integrity=False)
                except Exception as e:
                    raise CheckpointError(f"cannot read {mdir}: {_first_line(e)}") from None
            if writer is not None:
                for lay in step:
                    full = loaded[lay.megatron_name].reshape(_full_shape(spec, lay))
                    for name, t in megatron_full_to_hf(spec, lay, full).items():
                        writer.add(name, t)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    stats = {}
    if writer is not None:
        config = dict(meta["hf_config"])
        config["torch_dtype"] = (
            meta["dtype"].replace("fp32", "float32").replace("bf16", "bfloat16").replace("fp16", "float16")
        )
        assets_dir = os.path.join(mdir, ASSETS_DIR)
        assets = (
            [os.path.join(assets_dir, f) for f in sorted(os.listdir(assets_dir))] if os.path.isdir(assets_dir) else []
        )
        writer.finish(config, assets)
        stats = {"bytes": writer.total_bytes}
    named_barrier(f"rank 0 to finish the HF directory {out}")
    return stats


def _full_shape(spec: ModelSpec, layout: ParamLayout) -> tuple[int, ...]:
    shapes = hf_shapes(spec)
    first = shapes[layout.hf_names[0]]
    if layout.partition_dim is None or len(layout.hf_names) == 1:
        return first
    rows = sum(shapes[n][0] for n in layout.hf_names)
    return (rows,) + tuple(first[1:])
