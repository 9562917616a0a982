"""Fact-lookup questions over the synthetic knowledge base.

    python examples/doc_lookup/dataset.py --out train.jsonl --n 1000 --seed 0

writes JSONL rows ``{"prompt": ..., "label": "<answer as written in the article>"}``.
The articles themselves are a fixed function of ``kb_corpus.CORPUS_SEED``, rebuilt in
memory by the agent, so no corpus file has to travel with the data;
``--dump-corpus FILE`` writes them out as JSONL for inspection.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

# Loaded by path (OpenRLHF): put examples/common and this folder on sys.path (examples/README.md).
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE.parent / "common"), str(_HERE)) if p not in sys.path]

from jsonl import write_jsonl  # noqa: E402
from kb_corpus import CORPUS_SEED, build_corpus  # noqa: E402
from kb_search import knowledge_base  # noqa: E402
from tool_protocol import render_instructions  # noqa: E402

PROMPT_TEMPLATE = """Answer the question using a knowledge base of short articles about fictional cities, \
companies and products. Search it, open the article about the question's subject, and copy the answer as the \
article states it.

{instructions}

Answer with just the fact, for example <answer>1874</answer> or <answer>Ada Quist</answer>.

Question: {question}
"""


@dataclass(frozen=True)
class Question:
    doc_id: str
    attribute: str
    text: str
    answer: str


def all_questions(corpus_seed: int = CORPUS_SEED) -> list[Question]:
    """Every question the corpus supports (one per stated fact)."""
    return [
        Question(a.doc_id, f.attribute, f.question, f.answer) for a in build_corpus(corpus_seed) for f in a.facts
    ]


def sample_questions(n: int, seed: int) -> list[Question]:
    """``n`` questions in a seed-shuffled order: all distinct while n <= the number of facts."""
    pool = all_questions()
    rng = random.Random(seed)
    out: list[Question] = []
    while len(out) < n:
        batch = pool[:]
        rng.shuffle(batch)
        out.extend(batch[: n - len(out)])
    return out


def make_prompt(question: str) -> str:
    return PROMPT_TEMPLATE.format(instructions=render_instructions(knowledge_base().tools()), question=question)


def generate(n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"prompt", "label"}``; the same (n, seed) always gives the same rows."""
    return [{"prompt": make_prompt(q.text), "label": q.answer} for q in sample_questions(n, seed)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output JSONL file")
    parser.add_argument("--n", type=int, default=1000, help="number of questions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump-corpus", default=None, help="also write the articles to this JSONL file")
    args = parser.parse_args(argv)
    rows = generate(args.n, args.seed)
    out = Path(args.out)
    write_jsonl(out, rows)
    print(f"wrote {len(rows)} questions to {out}")
    if args.dump_corpus:
        articles = [{"doc_id": a.doc_id, "title": a.title, "text": a.text} for a in build_corpus()]
        write_jsonl(args.dump_corpus, articles)
        print(f"wrote {len(articles)} articles to {args.dump_corpus}")


if __name__ == "__main__":
    main()
