"""The CPU quickstart data: regenerating gives the committed files byte for byte; the task is what it says."""

from __future__ import annotations

import filecmp
import os
import re

import pytest

from megarl.data.dataset import PromptDataset, PromptLoader
from megarl.data.quickstart import build_quickstart, target_words
from megarl.data.tokenization import PromptEncoder
from megarl.rewards import get_reward, score_batch

COMMITTED = os.path.join(os.path.dirname(__file__), "..", "..", "data", "quickstart")
FILES = ["train.jsonl", "val.jsonl", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]


def test_regenerating_gives_the_committed_files(tmp_path):
    paths = build_quickstart(str(tmp_path))
    assert paths == {
        "train": f"{tmp_path}/train.jsonl", "val": f"{tmp_path}/val.jsonl", "tokenizer": f"{tmp_path}/tokenizer",
    }
    for name in FILES:
        assert filecmp.cmp(tmp_path / name, os.path.join(COMMITTED, name), shallow=False), name
    assert sorted(os.listdir(tmp_path / "tokenizer")) == ["tokenizer.json", "tokenizer_config.json"]


def test_task_reward_separates_target_words_and_a_random_policy_scores_an_eighth():
    train = PromptDataset(os.path.join(COMMITTED, "train.jsonl"))
    val = PromptDataset(os.path.join(COMMITTED, "val.jsonl"))
    assert (len(train), len(val)) == (256, 32)
    targets = target_words(512)
    assert targets[0] == "w3" and targets[-1] == "w66" and len(targets) == 64
    enc = PromptEncoder(os.path.join(COMMITTED, "tokenizer"), "none")
    batch = PromptLoader(train, 8, seed=0).next_batch()
    ids = enc.encode_batch([r.prompt for r in batch])
    assert all(3 <= i < 67 for p in ids for i in p) and all(4 <= len(p) <= 8 for p in ids)
    fn = get_reward("token_fraction")
    # a response echoing its prompt (then EOS) scores 1; words outside the target set score 0; half and half 0.5
    responses = [enc.decode(p + [2]) for p in ids]
    assert score_batch(fn, responses, batch) == [1.0] * 8
    assert score_batch(fn, [enc.decode([100, 200, 5, 6])], batch[:1]) == [0.5]
    uniform = [enc.decode(list(range(3, 512)))]
    assert score_batch(fn, uniform, batch[:1])[0] == pytest.approx(64 / 509)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=re.escape("vocab_size must be >= 11")):
        build_quickstart(str(tmp_path), vocab_size=8)
    with pytest.raises(ValueError, match=re.escape("n_train and n_val must be >= 1, got 0, 1")):
        build_quickstart(str(tmp_path), n_train=0, n_val=1)
