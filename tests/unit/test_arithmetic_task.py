"""The quickstart's addition task (`megarl.data.arithmetic`) and SFT batches (`megarl.trainer.sft.sft_batch`).

Expected values are written by hand here (token ids from the documented vocabulary, sums, masks)."""

from __future__ import annotations

import json

import pytest

from megarl.data.arithmetic import MODEL_VOCAB, VOCAB, build_arithmetic, splits


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_arithmetic(str(tmp_path_factory.mktemp("addition")), n_val=50, seed=0)


def test_splits_cover_every_problem_once_and_are_seeded():
    train, val = splits(n_val=200, seed=0)
    assert len(train) == 7900 and len(val) == 200
    prompts = [r["prompt"] for r in train + val]
    assert len(set(prompts)) == 90 * 90
    for r in train[:50] + val[:50]:
        a, b = (int(x) for x in r["prompt"][:-1].split("+"))
        assert r["answer"] == str(a + b) and 10 <= a <= 99 and 10 <= b <= 99
    assert splits(n_val=200, seed=0) == (train, val)
    assert splits(n_val=200, seed=1)[1] != val
    with pytest.raises(ValueError, match="n_val"):
        splits(n_val=0)


def test_files_and_tokenizer_round_trip(task):
    from transformers import AutoConfig, AutoTokenizer

    val = [json.loads(line) for line in open(task["val"])]
    assert len(val) == 50 and len(open(task["train"]).readlines()) == 8100 - 50
    tok = AutoTokenizer.from_pretrained(task["model"])
    # <s>=1, digits 0..9 = 3..12, '+' = 13, '=' = 14 (the module docstring's table)
    assert tok("37+48=").input_ids == [1, 6, 10, 13, 7, 11, 14]
    assert tok.decode([11, 8, 2], skip_special_tokens=True) == "85"
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0 and len(VOCAB) == 15
    cfg = AutoConfig.from_pretrained(task["model"])
    assert cfg.vocab_size == MODEL_VOCAB == 256 and cfg.head_dim == 32


def test_sft_batch_masks_the_answer_and_eos(task):
    from megarl.data.tokenization import PromptEncoder
    from megarl.trainer.sft import sft_batch

    enc = PromptEncoder(task["model"], "none")
    b = sft_batch(enc, [{"prompt": "37+48=", "answer": "85"}, {"prompt": "99+99=", "answer": "198"}])
    assert b["input_ids"].tolist() == [[1, 6, 10, 13, 7, 11, 14, 11, 8, 2, 0],
                                       [1, 12, 12, 13, 12, 12, 14, 4, 12, 11, 2]]
    assert b["response_mask"].tolist() == [[0] * 7 + [1, 1, 1, 0], [0] * 7 + [1, 1, 1, 1]]
    assert b["attention_mask"].tolist() == [[1] * 10 + [0], [1] * 11]
