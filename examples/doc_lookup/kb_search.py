"""BM25 search over the knowledge base, and the ``search`` / ``open`` tools.

A small Okapi BM25 in pure Python: the corpus has a few hundred short articles, so an
inverted index of dicts answers a query in well under a millisecond and needs no
dependency beyond the standard library.
"""

from __future__ import annotations

import functools
import math
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

# Loaded by path (OpenRLHF): put examples/common and this folder on sys.path (examples/README.md).
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE.parent / "common"), str(_HERE)) if p not in sys.path]

from kb_corpus import CORPUS_SEED, Article, build_corpus  # noqa: E402
from tool_protocol import Param, Tool, ToolCallError  # noqa: E402

TOP_K = 5
MAX_OPEN_CHARS = 2000
MAX_SNIPPET_CHARS = 160
MAX_QUERY_CHARS = 500
# Title words count this many times, since a question names its article's subject.
TITLE_WEIGHT = 2

STOPWORDS = frozenset(
    "a an and are as at be by did do does for from has have how in is it its of on or the to was were what when "
    "where which who whom whose why with".split()
)
_TOKEN_RE = re.compile(r"[a-z0-9]+")
_SENTENCE_RE = re.compile(r"(?<=[.!?])\s+")


def tokenize(text: str) -> list[str]:
    return [t for t in _TOKEN_RE.findall(text.lower()) if t not in STOPWORDS]


@dataclass(frozen=True)
class Hit:
    doc_id: str
    title: str
    score: float
    snippet: str


class BM25Index:
    """Okapi BM25 (k1=1.5, b=0.75) over title + text of each article."""

    def __init__(self, articles: Sequence[Article], k1: float = 1.5, b: float = 0.75):
        self.articles = list(articles)
        self.by_id = {a.doc_id: a for a in self.articles}
        self.k1, self.b = k1, b
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.lengths: list[int] = []
        for i, article in enumerate(self.articles):
            tokens = tokenize(article.title) * TITLE_WEIGHT + tokenize(article.text)
            self.lengths.append(len(tokens))
            for term, tf in Counter(tokens).items():
                self.postings[term].append((i, tf))
        n = len(self.articles)
        self.avg_length = sum(self.lengths) / max(1, n)
        self.idf = {t: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()}

    def scores(self, query: str) -> dict[int, float]:
        scores: dict[int, float] = defaultdict(float)
        for term in set(tokenize(query)):
            idf = self.idf.get(term)
            if idf is None:
                continue
            for i, tf in self.postings[term]:
                norm = self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avg_length)
                scores[i] += idf * tf * (self.k1 + 1) / (tf + norm)
        return scores

    def search(self, query: str, k: int = TOP_K) -> list[Hit]:
        """The ``k`` best articles for ``query`` (ties broken by doc id, so results are deterministic)."""
        ranked = sorted(self.scores(query).items(), key=lambda item: (-item[1], item[0]))[:k]
        return [
            Hit(self.articles[i].doc_id, self.articles[i].title, score, _snippet(self.articles[i].text))
            for i, score in ranked
        ]


def _snippet(text: str) -> str:
    """The article's first sentence, cut to MAX_SNIPPET_CHARS.

    The lead identifies the article without giving away most facts, so answering
    usually takes an ``open`` after the ``search``.
    """
    lead = _SENTENCE_RE.split(text, maxsplit=1)[0]
    return lead if len(lead) <= MAX_SNIPPET_CHARS else lead[: MAX_SNIPPET_CHARS - 3] + "..."


class KnowledgeBase:
    """The articles, their index, and the two tools over them."""

    def __init__(self, articles: Sequence[Article]):
        self.index = BM25Index(articles)

    def search(self, query: str) -> str:
        if not query.strip():
            raise ToolCallError("search: the query is empty; use words from the question, such as a name")
        if len(query) > MAX_QUERY_CHARS:
            raise ToolCallError(f"search: the query is too long ({len(query)} characters, limit {MAX_QUERY_CHARS})")
        hits = self.index.search(query)
        if not hits:
            return "No articles matched the query. Try other words, such as a name from the question."
        return "\n".join(f"{n}. {h.doc_id} | {h.title} | {h.snippet}" for n, h in enumerate(hits, 1))

    def open(self, doc_id: str) -> str:
        key = doc_id.strip().lower()
        article = self.index.by_id.get(key)
        if article is None:
            raise ToolCallError(
                f"open: unknown doc_id {doc_id!r}; use an id returned by search, such as "
                f"{self.index.articles[0].doc_id}"
            )
        text = f"{article.doc_id}: {article.title}\n\n{article.text}"
        if len(text) > MAX_OPEN_CHARS:
            text = text[:MAX_OPEN_CHARS] + "\n... [article truncated]"
        return text

    def tools(self) -> tuple[Tool, ...]:
        first = self.index.articles[0]
        return (
            Tool(
                name="search",
                description=f"Searches the knowledge base and returns the {TOP_K} best articles "
                "(id | title | first sentence).",
                params=(Param("query", str, "keywords, such as the name the question is about", example=first.title),),
                fn=self.search,
            ),
            Tool(
                name="open",
                description=f"Returns the full text of one article (at most {MAX_OPEN_CHARS} characters).",
                params=(Param("doc_id", str, "an article id returned by search", example=first.doc_id),),
                fn=self.open,
            ),
        )


@functools.lru_cache(maxsize=4)
def knowledge_base(seed: int = CORPUS_SEED) -> KnowledgeBase:
    """The knowledge base for ``seed``, built once per process."""
    return KnowledgeBase(build_corpus(seed))
