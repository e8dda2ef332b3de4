"""PromptDataset (jsonl / parquet, every error names file, line and key) and PromptLoader (determinism, resume)."""

from __future__ import annotations

import itertools
import json
import re
from types import SimpleNamespace

import pytest

from megarl.data.dataset import DatasetError, PromptDataset, PromptLoader, PromptRecord


def _write(tmp_path, text, name="d.jsonl"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _jsonl(tmp_path, rows, name="d.jsonl"):
    return _write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows), name)


def test_loads_string_and_chat_prompts_with_optional_answer(tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    path = _jsonl(tmp_path, [{"prompt": "hi", "answer": "4", "extra": 1}, {"prompt": msgs}])
    ds = PromptDataset(path)
    assert len(ds) == 2
    assert ds[0] == PromptRecord(index=0, prompt="hi", answer="4", record={"prompt": "hi", "answer": "4", "extra": 1})
    assert ds[1].prompt == msgs and ds[1].answer is None


def test_custom_keys_and_blank_lines_are_not_records(tmp_path):
    path = _write(tmp_path, '{"q": "a", "sol": 1}\n\n   \n{"q": "b"}\n')
    ds = PromptDataset(path, prompt_key="q", answer_key="sol")
    assert [r.prompt for r in ds] == ["a", "b"] and [r.index for r in ds] == [0, 1] and ds[0].answer == 1


def test_missing_prompt_key_names_file_line_and_key(tmp_path):
    path = _write(tmp_path, '{"prompt": "a"}\n\n{"question": "b"}\n')
    with pytest.raises(
        DatasetError, match=re.escape(f"{path}:3: missing prompt key 'prompt' (record has keys ['question'])")
    ):
        PromptDataset(path)


def test_malformed_line_names_line_number(tmp_path):
    path = _write(tmp_path, '{"prompt": "a"}\n{"prompt": "b",\n')
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: malformed JSON (")):
        PromptDataset(path)


@pytest.mark.parametrize(
    "line, message",
    [
        ('["a"]', "expected a JSON object, got list"),
        ('{"prompt": 3}', "key 'prompt' must be a string or a list of chat messages, got int"),
        ('{"prompt": "  "}', "key 'prompt' is an empty string"),
        ('{"prompt": []}', "key 'prompt' is an empty message list"),
        ('{"prompt": [{"role": "user"}]}', "key 'prompt' message 0 must be an object with string 'role' and 'content'"),
    ],
)
def test_bad_records_are_errors(tmp_path, line, message):
    path = _write(tmp_path, '{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: {message}")):
        PromptDataset(path)


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_file_is_an_error(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: the dataset is empty (no records)")):
        PromptDataset(path)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"prompt dataset '{tmp_path}/nope.jsonl' does not exist")):
        PromptDataset(str(tmp_path / "nope.jsonl"))
    path = _write(tmp_path, "prompt\n", "d.csv")
    with pytest.raises(DatasetError, match=re.escape(f"{path}: unsupported dataset format; use .jsonl")):
        PromptDataset(path)


def test_parquet(tmp_path):
    path = str(tmp_path / "d.parquet")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        open(path, "wb").close()
        with pytest.raises(
            DatasetError, match=re.escape(f"{path}: reading .parquet needs pyarrow, which is not installed")
        ):
            PromptDataset(path)
        return
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    assert [(r.prompt, r.answer) for r in PromptDataset(path)] == [("a", "1"), ("b", "2")]
    pq.write_table(pa.table({"q": ["a"]}), path)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: row 0: missing prompt key 'prompt'")):
        PromptDataset(path)


def test_from_config_and_batches(tmp_path):
    path = _jsonl(tmp_path, [{"prompt": str(i)} for i in range(5)])
    data = SimpleNamespace(train_path=path, val_path=None, prompt_key="prompt", answer_key="answer")
    ds = PromptDataset.from_config(data, "train")
    assert [[r.prompt for r in b] for b in ds.batches(2)] == [["0", "1"], ["2", "3"], ["4"]]
    with pytest.raises(DatasetError, match=re.escape("data.val_path is not set")):
        PromptDataset.from_config(data, "val")


# ------------------------------------------------------------------------------------------------ loader
def _ds(tmp_path, n):
    return PromptDataset(_jsonl(tmp_path, [{"prompt": f"p{i}"} for i in range(n)]))


def _ids(batches):
    return [[r.index for r in b] for b in batches]


def _take(loader, k):
    return _ids(loader.next_batch() for _ in range(k))


def test_loader_no_shuffle_carries_partial_batch_into_next_epoch(tmp_path):
    loader = PromptLoader(_ds(tmp_path, 5), prompts_per_step=2, shuffle=False)
    assert _take(loader, 4) == [[0, 1], [2, 3], [4, 0], [1, 2]]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 3


def test_loader_shuffle_is_deterministic_and_each_epoch_a_permutation(tmp_path):
    ds = _ds(tmp_path, 10)
    a = _take(PromptLoader(ds, 5, shuffle=True, seed=7), 6)
    assert a == _take(PromptLoader(ds, 5, shuffle=True, seed=7), 6)
    assert a != _take(PromptLoader(ds, 5, shuffle=True, seed=8), 6)
    flat = [i for b in a for i in b]
    epochs = [flat[0:10], flat[10:20], flat[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]  # reshuffled every epoch


def test_loader_batch_larger_than_dataset(tmp_path):
    assert _take(PromptLoader(_ds(tmp_path, 3), 4, shuffle=False), 2) == [[0, 1, 2, 0], [1, 2, 0, 1]]


def test_loader_resume_continues_the_same_stream(tmp_path):
    ds = _ds(tmp_path, 7)
    ref = _take(PromptLoader(ds, 3, seed=1), 8)
    first = PromptLoader(ds, 3, seed=1)
    head = _take(first, 3)
    state = first.state_dict()
    resumed = PromptLoader(ds, 3, seed=1)
    resumed.load_state_dict(state)
    assert head + _take(resumed, 5) == ref
    assert _ids(itertools.islice(PromptLoader(ds, 3, seed=1), 8)) == ref  # iterating == next_batch()


def test_loader_resume_mismatch_and_bad_args(tmp_path):
    ds = _ds(tmp_path, 7)
    state = PromptLoader(ds, 3, seed=1).state_dict()
    with pytest.raises(
        ValueError, match=re.escape("cannot resume the prompt loader: saved seed=1 but this loader has seed=2")
    ):
        PromptLoader(ds, 3, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=re.escape("saved dataset_size=7 but this loader has dataset_size=4")):
        PromptLoader(_ds(tmp_path, 4), 3, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=re.escape("epoch=0, position=9 out of range for a dataset of 7 records")):
        PromptLoader(ds, 3, seed=1).load_state_dict({"epoch": 0, "position": 9})
    with pytest.raises(ValueError, match=re.escape("prompts_per_step must be >= 1, got 0")):
        PromptLoader(ds, 0)
    with pytest.raises(ValueError, match=re.escape("PromptLoader needs a non-empty dataset")):
        PromptLoader([], 1)
