"""Reading and writing HuggingFace model directories (safetensors), tensor by tensor.

`HFReader` validates a directory up front (config, index, every expected tensor present with the shape the
config implies, no truncated file) and then reads single tensors or slices of them; each read opens its file
and closes it again, so memory-mapped pages never accumulate beyond the tensor being read.
`HFWriter` streams tensors into size-bounded safetensors shards inside a temporary directory and renames it
into place when `finish` writes the index, config, generation config and tokenizer files.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.checkpoint.atomic import check_output_dir, commit_dir, make_temp_dir
from megarl.checkpoint.errors import CheckpointError
from megarl.checkpoint.name_map import hf_shapes
from megarl.models.spec import ModelSpec, UnsupportedModelError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"HF directory {hf_dir} does not exist")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} not found: not a HuggingFace model directory")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON (line {e.lineno}): {e.msg}") from None


def spec_from_hf_config(cfg: dict) -> ModelSpec:
    try:
        return ModelSpec.from_hf_config(cfg)
    except UnsupportedModelError as e:
        raise CheckpointError(str(e)) from None


class HFReader:
    """A validated HF directory: `spec`, `dtype`, and slice reads of its tensors."""

    def __init__(self, hf_dir: str) -> None:
        self.hf_dir = hf_dir
        self.config = read_hf_config(hf_dir)
        self.spec = spec_from_hf_config(self.config)
        self.files = self._weight_map()
        self._validate()

    def _weight_map(self) -> dict[str, str]:
        index = os.path.join(self.hf_dir, INDEX_NAME)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
            return {k: os.path.join(self.hf_dir, v) for k, v in weight_map.items()}
        single = os.path.join(self.hf_dir, SINGLE_NAME)
        if os.path.isfile(single):
            return {k: single for k in self._keys(single)}
        raise CheckpointError(
            f"no {SINGLE_NAME} or {INDEX_NAME} in {self.hf_dir} (only safetensors checkpoints are supported)"
        )

    @staticmethod
    def _keys(path: str) -> list[str]:
        try:
            with safe_open(path, framework="pt") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise CheckpointError(
                f"cannot read {path}: {str(e).splitlines()[0]} (missing or truncated file?)"
            ) from None

    def _validate(self) -> None:
        expected = hf_shapes(self.spec)
        by_file: dict[str, list[str]] = {}
        for name in expected:
            if name not in self.files:
                raise CheckpointError(f"tensor {name} is missing from {self.hf_dir} (needed by config.json)")
            by_file.setdefault(self.files[name], []).append(name)
        dtypes = set()
        for path, names in by_file.items():
            if not os.path.isfile(path):
                raise CheckpointError(f"weight file {path} listed in the index is missing")
            size = os.path.getsize(path)
            try:
                with safe_open(path, framework="pt") as f:
                    keys = set(f.keys())
                    for name in names:
                        if name not in keys:
                            raise CheckpointError(f"tensor {name} is not in {path} although the index says so")
                        sl = f.get_slice(name)
                        shape = tuple(sl.get_shape())
                        if shape != expected[name]:
                            raise CheckpointError(
                                f"tensor {name} has shape {list(shape)} but config.json implies {list(expected[name])}"
                            )
                        dtypes.add(sl.get_dtype())
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"cannot read {path}: {str(e).splitlines()[0]} (truncated file?)") from None
            # safetensors header: 8-byte length + JSON; data must reach the last tensor's end offset
            with open(path, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if size < 8 + n + end:
                raise CheckpointError(f"weight file {path} is truncated ({size} bytes, header needs {8 + n + end})")
        unknown = [d for d in dtypes if d not in _ST_DTYPES]
        if unknown:
            raise CheckpointError(f"unsupported tensor dtype(s) {unknown} in {self.hf_dir}")
        self.dtype = _ST_DTYPES[sorted(dtypes)[0]] if len(dtypes) == 1 else torch.float32

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """Tensor `name`, or its [start, stop) slice along `dim` (0 or 1); a new tensor, file closed after."""
        with safe_open(self.files[name], framework="pt") as f:
            if dim is None:
                return f.get_tensor(name)
            sl = f.get_slice(name)
            if dim == 0:
                return sl[start:stop]
            return sl[:, start:stop]

    def asset_files(self) -> list[str]:
        """Non-weight files to carry along (config, generation config, tokenizer, chat template)."""
        out = []
        for fname in sorted(os.listdir(self.hf_dir)):
            path = os.path.join(self.hf_dir, fname)
            if os.path.isfile(path) and not fname.endswith(WEIGHT_SUFFIXES) and fname != INDEX_NAME:
                out.append(path)
        return out


class HFWriter:
    """Stream tensors into safetensors shards of at most `max_shard_bytes`, then `finish` atomically."""

    def __init__(self, out: str, overwrite: bool = False, max_shard_bytes: int = 2 * 1024**3) -> None:
        check_output_dir(out, overwrite)
        self.out = out
        self.tmp = make_temp_dir(out, os.getpid())
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = os.path.join(self.tmp, f"part-{len(self._shards):05d}.safetensors")
        save_file(self._pending, path, metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending = {}
        self._pending_bytes = 0

    def finish(self, config: dict, assets: list[str]) -> None:
        """Write shards' final names, the index, `config.json` and the asset files; rename into place."""
        if self._pending:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = SINGLE_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(self.tmp, f"part-{i:05d}.safetensors"), os.path.join(self.tmp, final))
            weight_map.update({k: final for k in names})
        if n > 1:
            with open(os.path.join(self.tmp, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        for path in assets:
            if os.path.basename(path) != "config.json":
                shutil.copy2(path, os.path.join(self.tmp, os.path.basename(path)))
        with open(os.path.join(self.tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        commit_dir(self.tmp, self.out)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
