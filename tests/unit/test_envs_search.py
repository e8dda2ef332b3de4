"""The search environment: BM25 against hand-computed scores, the tools, an episode and its counts."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from megarl.data.dataset import PromptRecord
from megarl.envs import build_env_factory
from megarl.envs.base import EpisodeError, ModelTurn, ToolCall
from megarl.envs.search import BM25Index, answer_match

DOCS = [{"id": "eiffel", "title": "Eiffel Tower", "text": "The Eiffel Tower in Paris is 330 metres tall."},
        {"id": "colosseum", "title": "Colosseum", "text": "The Colosseum is an amphitheatre in Rome."},
        {"id": "louvre", "title": "Louvre", "text": "The Louvre in Paris is the most visited museum."}]


def test_bm25_scores_by_hand():
    index = BM25Index([{"text": "apple banana"}, {"text": "apple apple cherry"}, {"text": "durian"}])
    # N=3, df(apple)=2: idf = ln(1 + 1.5/2.5); avgdl = 2; k1=1.5, b=0.75
    idf = math.log(1.6)
    norm0 = 1.5 * (0.25 + 0.75 * 2 / 2)
    norm1 = 1.5 * (0.25 + 0.75 * 3 / 2)
    assert index.scores("Apple!") == pytest.approx([idf * 2.5 / (1 + norm0), idf * 2 * 2.5 / (2 + norm1), 0.0])
    assert [d.id for d, _ in index.search("apple", k=5)] == ["1", "0"]  # ids default to positions
    assert index.search("kiwi", k=5) == []


def record(answer="330 metres", documents=None) -> PromptRecord:
    rec = {"prompt": "How tall is the Eiffel Tower?", "answer": answer}
    if documents is not None:
        rec["documents"] = documents
    return PromptRecord(index=0, prompt=rec["prompt"], answer=answer, record=rec)


def calls(*pairs) -> ModelTurn:
    return ModelTurn(0, "", (), tool_calls=tuple(ToolCall(n, a, f"call_{i}") for i, (n, a) in enumerate(pairs)))


def test_episode_over_a_corpus_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    env = build_env_factory("search", {"corpus_path": str(path), "top_k": 2})()
    assert [t["function"]["name"] for t in env.tools()] == ["search", "open"]
    messages = asyncio.run(env.reset(record()))
    assert messages[0]["role"] == "system" and messages[1] == {"role": "user",
                                                               "content": "How tall is the Eiffel Tower?"}
    step = asyncio.run(env.step(calls(("search", {"query": "Paris tower"}), ("search", {"query": "zebra"}))))
    hits, empty = (m["content"] for m in step.observations)
    assert hits.splitlines()[0] == "[eiffel] Eiffel Tower" and "[louvre] Louvre" in hits and "colosseum" not in hits
    assert empty == "No documents match 'zebra'."
    step = asyncio.run(env.step(calls(("open", {"doc_id": "[eiffel]"}), ("open", {"doc_id": "nile"}))))
    assert step.observations[0]["content"] == "Eiffel Tower\n\nThe Eiffel Tower in Paris is 330 metres tall."
    assert step.observations[1]["content"].startswith("Error: no document with id 'nile'")
    final = asyncio.run(env.step(ModelTurn(1, "It is <answer>330 Metres</answer>", ())))
    assert final.done and final.reward == 1.0
    assert final.info == {"search/searches": 2, "search/empty_results": 1, "open/opens": 2, "open/misses": 1}


def test_episode_over_the_records_documents():
    factory = build_env_factory("search")
    env = factory()
    asyncio.run(env.reset(record(documents=DOCS[1:])))
    step = asyncio.run(env.step(calls(("search", {"query": "Rome"}))))
    assert step.observations[0]["content"].startswith("[colosseum] Colosseum")
    assert asyncio.run(env.step(ModelTurn(1, "<answer>300 metres</answer>", ()))).reward == 0.0
    with pytest.raises(EpisodeError, match="record 0: the search environment has no corpus"):
        asyncio.run(factory().reset(record()))


def test_answer_match():
    assert answer_match("blah <answer>x</answer> then <answer> Paris </answer>", "paris", {}) == 1.0
    assert answer_match("Paris", ["Rome", "paris"], {}) == 1.0
    assert answer_match("The answer is Paris", "Paris", {}) == 0.0
    assert answer_match("Paris", None, {}) == 0.0
