"""The search environment: the model looks things up in a local corpus with `search` and `open`, then answers.

Corpus: documents {"id", "title", "text"} — a `.jsonl` file (`corpus_path`, indexed once per process and shared by
the episodes), a list (`documents`, indexed per episode), or, when neither is given, the record's own "documents"
key (indexed per episode). Ranking: Okapi BM25 (k1=1.5, b=0.75, idf = ln(1 + (N - df + 0.5) / (df + 0.5)))
over lower-cased word tokens.

Tools: search(query) -> the top-k documents' ids, titles and snippets; open(doc_id) -> a document's full text.
Reward: `answer_match` by default — the text of the last <answer>...</answer> (else the whole final reply) equals
the record's answer (or one of a list of answers) after whitespace collapsing and case folding. The final info
counts the episode's searches and opens ("search/searches", "open/opens", "open/misses").
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import re
from typing import Any, Optional, Sequence

from megarl.envs.base import EpisodeError, Message
from megarl.envs.registry import register_env
from megarl.envs.tool_env import ToolEnvironment
from megarl.envs.tools import Tool
from megarl.rewards.builtin import normalize_text

_WORD = re.compile(r"\w+")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
SNIPPET_CHARS = 160


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclasses.dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str


def as_documents(items: Sequence[Any]) -> list[Document]:
    """Documents from dicts ({"id"?, "title"?, "text"}: id defaults to the position, title to '') or Documents.
    Duplicate ids are an error."""
    docs = []
    for i, item in enumerate(items):
        if isinstance(item, Document):
            docs.append(item)
            continue
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise ValueError(f"document {i}: expected a dict with a string 'text', got {str(item)[:80]!r}")
        docs.append(Document(id=str(item.get("id", i)), title=str(item.get("title", "")), text=item["text"]))
    seen = collections.Counter(d.id for d in docs)
    duplicated = sorted(k for k, n in seen.items() if n > 1)
    if duplicated:
        raise ValueError(f"duplicate document ids: {duplicated[:5]}")
    return docs


class BM25Index:
    """Okapi BM25 over `documents` (title and text together)."""

    def __init__(self, documents: Sequence[Any], k1: float = 1.5, b: float = 0.75) -> None:
        self.documents = as_documents(documents)
        self.by_id = {d.id: d for d in self.documents}
        self.k1, self.b = k1, b
        self.term_freqs = [collections.Counter(tokenize(f"{d.title} {d.text}")) for d in self.documents]
        self.lengths = [sum(tf.values()) for tf in self.term_freqs]
        self.avg_length = (sum(self.lengths) / len(self.lengths)) if self.lengths else 0.0
        df = collections.Counter(term for tf in self.term_freqs for term in tf)
        n = len(self.documents)
        self.idf = {term: math.log(1.0 + (n - f + 0.5) / (f + 0.5)) for term, f in df.items()}

    def scores(self, query: str) -> list[float]:
        """[len(documents)] BM25 scores of `query`."""
        terms = [t for t in tokenize(query) if t in self.idf]
        out = []
        for tf, length in zip(self.term_freqs, self.lengths):
            norm = self.k1 * (1.0 - self.b + self.b * length / self.avg_length) if self.avg_length else self.k1
            out.append(sum(self.idf[t] * tf[t] * (self.k1 + 1.0) / (tf[t] + norm) for t in terms if t in tf))
        return out

    def search(self, query: str, k: int) -> list[tuple[Document, float]]:
        """The `k` best documents with a positive score, best first (ties: corpus order)."""
        ranked = sorted(enumerate(self.scores(query)), key=lambda p: (-p[1], p[0]))
        return [(self.documents[i], s) for i, s in ranked[:k] if s > 0]


@functools.lru_cache(maxsize=4)
def _load_corpus(path: str, mtime: float) -> BM25Index:
    with open(path, encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    return BM25Index(items)


def load_corpus(path: str) -> BM25Index:
    """The BM25 index of a `.jsonl` corpus (cached per path and modification time)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"search corpus {path!r} does not exist")
    return _load_corpus(os.path.abspath(path), os.path.getmtime(path))


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SNIPPET_CHARS else text[:SNIPPET_CHARS].rsplit(" ", 1)[0] + " ..."


class SearchTool(Tool):
    """search(query): the top-k documents. Counts "searches" and "empty_results"."""

    name = "search"

    def __init__(self, index: Optional[BM25Index], top_k: int = 3) -> None:
        super().__init__()
        self.index = index
        self.top_k = top_k

    def run(self, query: str) -> str:
        """Search the document collection; returns the best matches' ids, titles and snippets.

        Args:
            query: Keywords to search for.
        """
        self.count("searches")
        hits = self.index.search(query, self.top_k)
        if not hits:
            self.count("empty_results")
            return f"No documents match {query!r}."
        return "\n".join(f"[{doc.id}] {doc.title}\n{_snippet(doc.text)}" for doc, _ in hits)


class OpenTool(Tool):
    """open(doc_id): a document's full text. Counts "opens" and "misses" (unknown ids)."""

    name = "open"

    def __init__(self, index: Optional[BM25Index]) -> None:
        super().__init__()
        self.index = index

    def run(self, doc_id: str) -> str:
        """Open a document by its id (as shown in brackets by search) and return its full text.

        Args:
            doc_id: The document's id.
        """
        self.count("opens")
        doc = self.index.by_id.get(doc_id.strip().strip("[]"))
        if doc is None:
            self.count("misses")
            return f"Error: no document with id {doc_id!r}; use the ids that search returns."
        return f"{doc.title}\n\n{doc.text}" if doc.title else doc.text


def answer_match(response_text: str, answer: Optional[Any], record: dict[str, Any]) -> float:
    """1.0 when the last <answer>...</answer> of the response (else the whole response) equals the answer, or
    one of a list of answers, after `normalize_text`."""
    if answer is None:
        return 0.0
    found = _ANSWER.findall(response_text)
    given = normalize_text(found[-1] if found else response_text)
    answers = answer if isinstance(answer, (list, tuple)) else [answer]
    return float(any(given == normalize_text(a) for a in answers))


SEARCH_SYSTEM_PROMPT = ("Answer the question using the document collection: call search(query) to find documents "
                        "and open(doc_id) to read one. When you know the answer, reply without a tool call and put "
                        "the answer in <answer></answer>.")


class SearchEnvironment(ToolEnvironment):
    """One search episode over `index` (or, when None, over the record's "documents")."""

    def __init__(self, index: Optional[BM25Index] = None, *, top_k: int = 3, reward_fn: Any = answer_match,
                 system_prompt: Optional[str] = SEARCH_SYSTEM_PROMPT, max_tool_calls_per_turn: int = 4,
                 max_output_chars: int = 2000, tool_timeout_s: Optional[float] = 10.0) -> None:
        self.search_tool = SearchTool(index, top_k)
        self.open_tool = OpenTool(index)
        super().__init__([self.search_tool, self.open_tool], reward_fn, system_prompt=system_prompt,
                         max_tool_calls_per_turn=max_tool_calls_per_turn, max_output_chars=max_output_chars,
                         tool_timeout_s=tool_timeout_s)
        self.shared_index = index

    async def reset(self, record: Any) -> list[Message]:
        if self.shared_index is None:
            documents = record.record.get("documents")
            if not documents:
                raise EpisodeError(f"record {record.index}: the search environment has no corpus (corpus_path / "
                                   f"documents) and the record has no 'documents'")
            try:
                index = BM25Index(documents)
            except ValueError as e:
                raise EpisodeError(f"record {record.index}: 'documents': {e}") from e
            self.search_tool.index = self.open_tool.index = index
        return await super().reset(record)


@register_env("search")
def search_env(corpus_path: Optional[str] = None, documents: Optional[Sequence[Any]] = None, top_k: int = 3,
               reward_fn: Any = answer_match, system_prompt: Optional[str] = SEARCH_SYSTEM_PROMPT,
               max_tool_calls_per_turn: int = 4, max_output_chars: int = 2000,
               tool_timeout_s: Optional[float] = 10.0) -> SearchEnvironment:
    """One search episode over `corpus_path` (.jsonl), `documents`, or each record's "documents"."""
    if corpus_path is not None and documents is not None:
        raise ValueError("give the search corpus as corpus_path or documents, not both")
    index = load_corpus(corpus_path) if corpus_path is not None else None
    if documents is not None:
        index = BM25Index(documents)  # per episode: small in-config corpora; a large one belongs in corpus_path
    return SearchEnvironment(index, top_k=top_k, reward_fn=reward_fn, system_prompt=system_prompt,
                             max_tool_calls_per_turn=max_tool_calls_per_turn, max_output_chars=max_output_chars,
                             tool_timeout_s=tool_timeout_s)
