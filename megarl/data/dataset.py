"""Prompt datasets and the per-step prompt loader.

Data path: a `.jsonl` (one JSON object per line) or `.parquet` file (only when `pyarrow` is importable) ->
`PromptDataset` (every record checked when loaded: never silently dropped) -> `PromptLoader` (lists of
`prompts_per_step` records per RL step, epoch after epoch, resumable) -> `megarl.data.tokenization.PromptEncoder`.

A record's `prompt_key` holds a string or a list of chat messages (``{"role": ..., "content": ...}``); its
`answer_key` (optional) holds the reference answer handed to the reward function. Other fields are kept and
reach the reward function unchanged (`PromptRecord.record`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Any, Iterator, Optional, Sequence, Union

Prompt = Union[str, list[dict[str, Any]]]


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file, the line (or row) and the key."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt of a dataset.

    index: position in the dataset file (0-based; the jsonl line is not the index when there are blank lines).
    prompt: the `prompt_key` value: a non-empty string, or a non-empty list of chat messages.
    answer: the `answer_key` value, or None when the record has none (reward functions decide what that means).
    record: the whole record as read from the file (all keys), passed to reward functions.
    """

    index: int
    prompt: Prompt
    answer: Optional[Any]
    record: dict[str, Any]


def _check_prompt(value: Any, where: str, prompt_key: str) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: key {prompt_key!r} is an empty string")
        return value
    if isinstance(value, list):
        if not value:
            raise DatasetError(f"{where}: key {prompt_key!r} is an empty message list")
        for i, msg in enumerate(value):
            if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
                raise DatasetError(
                    f"{where}: key {prompt_key!r} message {i} must be an object with string 'role' and 'content', "
                    f"got {msg!r:.80}"
                )
        return value
    raise DatasetError(
        f"{where}: key {prompt_key!r} must be a string or a list of chat messages, got {type(value).__name__}"
    )


def _make_record(raw: Any, index: int, where: str, prompt_key: str, answer_key: Optional[str]) -> PromptRecord:
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    if prompt_key not in raw:
        raise DatasetError(f"{where}: missing prompt key {prompt_key!r} (record has keys {sorted(raw)})")
    prompt = _check_prompt(raw[prompt_key], where, prompt_key)
    answer = raw.get(answer_key) if answer_key else None
    return PromptRecord(index=index, prompt=prompt, answer=answer, record=raw)


def _read_jsonl(path: str, prompt_key: str, answer_key: Optional[str]) -> list[PromptRecord]:
    records: list[PromptRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not records
            where = f"{path}:{lineno}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            records.append(_make_record(raw, len(records), where, prompt_key, answer_key))
    return records


def _read_parquet(path: str, prompt_key: str, answer_key: Optional[str]) -> list[PromptRecord]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            f"{path}: reading .parquet needs pyarrow, which is not installed (pip install pyarrow), "
            "or convert the file to .jsonl"
        ) from None
    rows = pq.read_table(path).to_pylist()
    return [_make_record(raw, i, f"{path}: row {i}", prompt_key, answer_key) for i, raw in enumerate(rows)]


class PromptDataset:
    """All records of a prompt file, loaded and checked eagerly (datasets of prompts are small).

    Errors (`DatasetError`, `FileNotFoundError`) name the file, the line (jsonl, 1-based) or row (parquet,
    0-based) and the key: a missing prompt key, a prompt that is neither a string nor a message list, a malformed
    JSON line, a line that is not an object, an empty file.
    """

    def __init__(self, path: str, prompt_key: str = "prompt", answer_key: Optional[str] = "answer") -> None:
        self.path = path
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompt dataset {path!r} does not exist")
        if path.endswith(".jsonl"):
            self.records = _read_jsonl(path, prompt_key, answer_key)
        elif path.endswith(".parquet"):
            self.records = _read_parquet(path, prompt_key, answer_key)
        else:
            raise DatasetError(f"{path}: unsupported dataset format; use .jsonl (or .parquet with pyarrow installed)")
        if not self.records:
            raise DatasetError(f"{path}: the dataset is empty (no records)")

    @classmethod
    def from_config(cls, data: Any, split: str = "train") -> "PromptDataset":
        """From a `DataConfig`: split 'train' reads `train_path`, 'val' reads `val_path` (must be set)."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        path = data.train_path if split == "train" else data.val_path
        if path is None:
            raise DatasetError(f"data.{split}_path is not set")
        return cls(path, prompt_key=data.prompt_key, answer_key=data.answer_key)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    def batches(self, size: int) -> Iterator[list[PromptRecord]]:
        """One pass in file order, `size` records at a time, the last batch possibly smaller (validation)."""
        if size < 1:
            raise ValueError(f"batch size must be >= 1, got {size}")
        for start in range(0, len(self.records), size):
            yield self.records[start:start + size]


class PromptLoader:
    """Lists of `prompts_per_step` records, one per RL step, forever, epoch after epoch.

    The records form one endless stream: epoch e's order (a permutation seeded by (seed, e) when `shuffle`, else
    file order) followed by epoch e+1's. Step k takes the next `prompts_per_step` records of the stream, so a
    last partial batch of an epoch is completed from the start of the next epoch (nothing is dropped; when
    `prompts_per_step` does not divide the dataset, a step can contain records from two epochs, and with
    `prompts_per_step > len(dataset)` the same record twice). The stream depends only on (dataset size, shuffle,
    seed), so it is deterministic, and `state_dict()` (epoch, position within the epoch) resumes it exactly.
    """

    def __init__(
        self, dataset: Sequence[PromptRecord], prompts_per_step: int, shuffle: bool = True, seed: int = 0
    ) -> None:
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if len(dataset) == 0:
            raise ValueError("PromptLoader needs a non-empty dataset")
        self.dataset = dataset
        self.prompts_per_step = prompts_per_step
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0  # epoch of the next record
        self.position = 0  # index into the epoch's order of the next record
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, size: Optional[int] = None) -> list[PromptRecord]:
        """The next step's records: exactly `size` (default `prompts_per_step`; more when the rollout over-samples,
        `rollout.oversample`), crossing into the next epoch's order when this one runs out."""
        size = self.prompts_per_step if size is None else size
        if size < 1:
            raise ValueError(f"PromptLoader.next_batch: size must be >= 1 record, got {size}")
        out: list[PromptRecord] = []
        while len(out) < size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(size - len(out), len(self._order) - self.position)
            out.extend(self.dataset[i] for i in self._order[self.position:self.position + take])
            self.position += take
        return out

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: the next record is record `position` of epoch `epoch`'s order."""
        return {"epoch": self.epoch, "position": self.position, "dataset_size": len(self.dataset),
                "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`. The dataset size, shuffle and seed must match (else the order differs)."""
        for key, mine in (("dataset_size", len(self.dataset)), ("shuffle", self.shuffle), ("seed", self.seed)):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"cannot resume the prompt loader: saved {key}={state[key]!r} but this loader has {key}={mine!r}"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.dataset):
            raise ValueError(f"cannot resume the prompt loader: epoch={epoch}, position={position} out of range "
                             f"for a dataset of {len(self.dataset)} records")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
