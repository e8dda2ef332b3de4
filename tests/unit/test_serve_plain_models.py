"""`megarl serve` on a model without a chat template (the `megarl quickstart` export: a character tokenizer, raw
prompt text): /v1/completions encodes a text prompt with the tokenizer's special tokens (its BOS), as megarl's
`data.chat_template: none` and vLLM's /v1/completions do, so the served model sees what the trainer's validation
fed it; /v1/chat/completions answers 400 naming the missing template; the context defaults to the model's
positions. The real engine behind `megarl serve` on the quickstart's export runs in
tests/e2e/test_quickstart_addition.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from megarl.data.arithmetic import VOCAB, build_char_tokenizer
from megarl.envs.tool_calls import get_parser
from megarl.rollout.engine import Completion, GenerationOutput
from megarl.serving.openai_api import create_app
from megarl.serving.openai_protocol import OpenAIProtocol, ServeLimits


class FixedAnswer:
    """A `RolloutClient` that answers "85" + EOS to every request and records the requests it got."""

    replicas = 1
    weight_version = 0

    def __init__(self):
        self.requests = []

    async def generate(self, request, *, session_id=None, priority=0, timeout_s=None):
        self.requests.append(request)
        ids = [VOCAB["8"], VOCAB["5"], VOCAB["</s>"]]
        completion = Completion(0, ids, [-0.5] * len(ids), "stop", [0] * len(ids))
        return GenerationOutput(request.request_id, list(request.prompt_ids), [completion], True)

    async def abort(self, request_ids):
        return 0

    def metrics(self):
        return {}


def _post(app, path: str, body: dict) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post(path, content=json.dumps(body).encode())
    return asyncio.run(go())


def test_a_text_prompt_gets_the_bos_and_chat_without_a_template_is_refused_by_name(tmp_path):
    tok = build_char_tokenizer(str(tmp_path / "tok"))
    assert not getattr(tok, "chat_template", None)
    policy = FixedAnswer()
    app = create_app(OpenAIProtocol(policy, tok, get_parser("hermes"), model_name="hf",
                                    limits=ServeLimits(max_model_len=64)))

    r = _post(app, "/v1/completions", {"model": "hf", "prompt": "25+60=", "max_tokens": 4, "temperature": 0,
                                       "return_token_ids": True})
    assert r.status_code == 200, r.text
    want = [VOCAB["<s>"]] + [VOCAB[c] for c in "25+60="]  # the BOS, then one id per character (the vocabulary's)
    assert policy.requests[0].prompt_ids == want and r.json()["prompt_token_ids"] == want
    assert r.json()["choices"][0]["text"] == "85"

    r = _post(app, "/v1/chat/completions", {"model": "hf", "messages": [{"role": "user", "content": "25+60="}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and "no chat template" in error["message"], error
    assert "/v1/completions" in error["message"]
    assert len(policy.requests) == 1  # the refused chat request never reached the engine


def _model_dir(path, positions: int):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    return str(path)


def test_the_context_defaults_to_the_models_positions_and_more_is_refused(tmp_path, capsys):
    from megarl.cli import SERVE_DEFAULT_MAX_MODEL_LEN, main, serve_context_len

    small, big = _model_dir(tmp_path / "small", 64), _model_dir(tmp_path / "big", 32768)
    assert serve_context_len(small, None) == 64
    assert serve_context_len(big, None) == SERVE_DEFAULT_MAX_MODEL_LEN == 2048
    assert serve_context_len(small, 48) == 48
    with pytest.raises(ValueError, match=r"--max-model-len 65 is over the model's max_position_embeddings \(64"):
        serve_context_len(small, 65)
    # through the CLI: refused before an engine is built (the directory holds no weights to load)
    assert main(["serve", small, "--max-model-len", "100"]) == 2
    assert "--max-model-len 100 is over the model's max_position_embeddings (64" in capsys.readouterr().err


def test_every_megarl_serve_flag_is_in_docs_serve_md_with_its_default():
    """docs/serve.md's options table has a row per `megarl serve` flag (read from the CLI's own parser), and a flag
    with a default shows that value in its row."""
    import argparse
    import os

    from megarl.cli import build_parser

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "serve.md")) as f:
        rows = {line.split("|")[1].strip().strip("`"): line for line in f if line.startswith("| `")}
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = [a for a in subparsers.choices["serve"]._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 13
    for action in flags:
        flag = action.option_strings[0]
        assert flag in rows, f"{flag} is not documented in docs/serve.md's options table"
        if action.default is not None:
            shown = action.default
            if isinstance(shown, float) and shown.is_integer():
                shown = int(shown)
            assert f"| {shown} |" in rows[flag], (flag, action.default, rows[flag])


def test_dtype_auto_is_the_checkpoints_own_dtype_not_vllms_downcast(tmp_path):
    """`--dtype auto` hands vLLM the dtype the checkpoint's config.json names. vLLM's own "auto" turns a float32
    checkpoint into bfloat16 on CPU (its `_resolve_auto_dtype`: "Downcast for float32 models"), which made `megarl
    serve` answer the fp32 quickstart export differently from the trainer's fp32 engine. Expected values: the dtype
    written into each config here (transformers 4 writes `torch_dtype`, transformers 5 `dtype`)."""
    from megarl.serving.openai_api import engine_dtype

    cases = {"v4_fp32": ({"torch_dtype": "float32"}, "float32"), "v5_fp32": ({"dtype": "float32"}, "float32"),
             "bf16": ({"torch_dtype": "bfloat16"}, "bfloat16"), "unnamed": ({}, "auto")}
    for name, (config, want) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
        assert engine_dtype(str(tmp_path / name), "auto") == want, name
    assert engine_dtype(str(tmp_path / "v5_fp32"), "bfloat16") == "bfloat16"  # an explicit --dtype is kept
