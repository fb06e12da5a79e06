"""Generated multi-document QA cases for ``chunkstore bench quality``: seeded, so runs compare.

A pool of documents, each stating two facts about people or things among ``filler``
sentences that answer nothing; every fact is unique in the pool, and every document's facts
have look-alikes in other documents (the same kind of fact about someone else: distractors).
The filler is either eight templated sentences (about 9 words each, repeated as needed) or,
with ``prose=True``, consecutive sentences of real English prose (about 25 words each), the
facts inserted between them at random places: the license texts Debian's ``base-files``
package (Essential, so on every Debian machine; slim container images drop /usr/share/doc,
not these) installs under ``/usr/share/common-licenses``. Sentences that are headings,
shouting, markup, or that name anything a question asks about (a city, a job, a person, a
price-like number) are left out.

A case puts ``docs_per_case`` documents of the pool in random order and asks one of three
kinds of question:
- ``one``: a fact stated in one of its documents;
- ``two``: two facts stated in two different documents, both needed in the answer;
- ``distracted``: a fact whose look-alike about another entity is also in the case.
The documents holding the answer stand at uniformly random slots of the case, and the case
says which (``Case.relevant``), so a bench can rank chunks by position, by relevance to the
question, or by that oracle. Cases share documents, so a store warmed by earlier cases
serves later ones.
"""

from __future__ import annotations

import errno
import functools
import random
import re
from dataclasses import dataclass
from pathlib import Path

SYS = "Read the documents, then answer the question in a few words."
FIRST = [
    "Alice",
    "Bruno",
    "Chen",
    "Dara",
    "Emil",
    "Farah",
    "Goran",
    "Hana",
    "Ivo",
    "Jun",
    "Kira",
    "Leon",
    "Mara",
    "Nils",
    "Olga",
    "Pavel",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
]
LAST = ["Moreau", "Novak", "Silva", "Berg", "Costa", "Ivanov", "Larsen", "Rossi", "Weber", "Kowal"]
CITIES = [
    "Paris",
    "Berlin",
    "Madrid",
    "Rome",
    "Oslo",
    "Vienna",
    "Lisbon",
    "Prague",
    "Dublin",
    "Athens",
    "Warsaw",
    "Helsinki",
    "Zurich",
    "Brussels",
    "Budapest",
]
JOBS = [
    "baker",
    "pilot",
    "doctor",
    "teacher",
    "farmer",
    "painter",
    "lawyer",
    "chef",
    "nurse",
    "sailor",
]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
THINGS = ["box", "car", "bike", "lamp", "door", "boat", "kettle", "clock"]
FILLER = [
    "The morning was quiet and the streets were still empty.",
    "Nobody remembered when the old bridge had last been painted.",
    "A light rain fell for most of the afternoon.",
    "The market opened early, as it does every Saturday.",
    "Several letters arrived later than expected that week.",
    "The library moved its history books to the second floor.",
    "Most visitors came by train and left before dark.",
    "The committee met twice but decided nothing new.",
]
# The held-out split (``generate(split=HELDOUT)``): other people, other filler sentences and
# other seeds, so that a setting tuned on the default split is checked on cases it never saw.
TUNE, HELDOUT = "tune", "heldout"
SPLITS = (TUNE, HELDOUT)
HELDOUT_SEED = 1_000_003  # added to the seed: the two splits never draw alike
HELDOUT_FIRST = [
    "Aino",
    "Bartek",
    "Cosmin",
    "Dagny",
    "Eero",
    "Fenna",
    "Gustav",
    "Hedda",
    "Iker",
    "Jolan",
    "Kaito",
    "Liesel",
    "Matteo",
    "Noor",
    "Orla",
    "Piet",
    "Ragna",
    "Saoirse",
    "Teodor",
    "Ulla",
]
HELDOUT_LAST = [
    "Andersen",
    "Brandt",
    "Dumont",
    "Eriksen",
    "Ferreira",
    "Horvat",
    "Jansen",
    "Kovacs",
    "Lindqvist",
    "Marino",
]
HELDOUT_FILLER = [
    "The printer on the third floor jammed again before lunch.",
    "A delivery of chairs was left in the hallway overnight.",
    "The quarterly newsletter went out a day late.",
    "Someone had watered the plants by the window twice.",
    "The heating came on earlier than usual this autumn.",
    "Two new desks were ordered for the reading room.",
    "The shared calendar listed a meeting that nobody attended.",
    "Coffee ran out halfway through the long afternoon.",
]
PROSE_DIR = Path("/usr/share/common-licenses")
PROSE_PACKAGE = "base-files"
# The prose-rich texts (Debian Policy 12.5 keeps them all in base-files), in a fixed order so
# that a seed draws the same cases anywhere; sentences repeated across them (GPL-2 and
# LGPL-2.1 share many) are kept once.
PROSE_FILES = (
    "GPL-3",
    "GPL-2",
    "LGPL-2.1",
    "LGPL-3",
    "GFDL-1.3",
    "MPL-2.0",
    "MPL-1.1",
    "Apache-2.0",
    "Artistic",
    "CC0-1.0",
)
# Legal sentences run long (25 words at the median); the longest would make one document
# twice the length of another at the same sentence count.
PROSE_MAX_WORDS = 50


@dataclass(frozen=True)
class Fact:
    kind: str  # "city", "job" or "price"
    subject: str  # a person, or "the red box"
    answer: str
    sentence: str
    question: str


@dataclass(frozen=True)
class Case:
    kind: str  # "one", "two" or "distracted"
    documents: tuple[str, ...]
    question: str
    answers: tuple[str, ...]  # every one must appear in the generated answer
    relevant: tuple[int, ...]  # the indices in documents holding the answers, in their order

    def correct(self, generated: str) -> bool:
        text = generated.lower()
        return all(answer.lower() in text for answer in self.answers)


def _facts(rng: random.Random, count: int, split: str = TUNE) -> list[Fact]:
    first, last = (HELDOUT_FIRST, HELDOUT_LAST) if split == HELDOUT else (FIRST, LAST)
    people = [f"{f} {la}" for f in first for la in last]
    objects = [f"the {c} {t}" for c in COLORS for t in THINGS]
    rng.shuffle(people)
    rng.shuffle(objects)
    facts: list[Fact] = []
    while len(facts) < count:
        kind = ("city", "job", "price")[len(facts) % 3]
        if kind == "city":
            who, city = people.pop(), rng.choice(CITIES)
            facts.append(
                Fact(kind, who, city, f"{who} lives in {city}.", f"In which city does {who} live?")
            )
        elif kind == "job":
            who, job = people.pop(), rng.choice(JOBS)
            facts.append(Fact(kind, who, job, f"{who} works as a {job}.", f"What is {who}'s job?"))
        else:
            what, price = objects.pop(), str(rng.randint(11, 99))
            facts.append(
                Fact(
                    kind,
                    what,
                    price,
                    f"{what.capitalize()} costs {price} dollars.",
                    f"How many dollars does {what} cost?",
                )
            )
    return facts


def _document(rng: random.Random, facts: list[Fact], filler: int, sentences: list[str]) -> str:
    few = filler <= len(sentences)  # distinct sentences while there are enough
    padding = rng.sample(sentences, filler) if few else rng.choices(sentences, k=filler)
    sentences = [f.sentence for f in facts] + padding
    rng.shuffle(sentences)
    return " ".join(sentences)


_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_NUMBERING = re.compile(r"^(\d+(\.\d+)*\.?|\([a-z0-9]+\)|[a-z0-9]\))\s+")
_SENTENCE_BREAK = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')]))\s+(?=[A-Z\"(])")
_SENTENCE_START = re.compile(r"[\"(]?[A-Z]")
_SENTENCE_END = re.compile(r"[.!?][\"')]?$")
_MARKUP = re.compile(r"[<>@`_|{}\[\]=\\*]|-{3,}|https?:|www\.|\(C\)")
_PRICE_LIKE = re.compile(r"\b(1[1-9]|[2-9]\d)\b")  # a number that could answer "how many dollars"
# Whatever a question asks about or a fact says: prose naming it would confuse a case.
_FACT_WORDS = re.compile(
    r"\b("
    + "|".join([*CITIES, *JOBS, *FIRST, *LAST, *HELDOUT_FIRST, *HELDOUT_LAST, *COLORS, *THINGS])
    + r"|city|job|lives in|works as|costs?|dollars?)\b",
    re.IGNORECASE,
)


def _is_prose(sentence: str) -> bool:
    words = sentence.split()
    letters = [c for c in sentence if c.isalpha()]
    return (
        _SENTENCE_START.match(sentence) is not None  # not the tail of a list item
        and 6 <= len(words) <= PROSE_MAX_WORDS  # headings ("Source Code.") are shorter
        and sum(w[0].isupper() for w in words) < 0.6 * len(words)  # Title Case: a heading
        and sum(c.isupper() for c in letters) < 0.3 * len(letters)  # no warranty shouting
        and _SENTENCE_END.search(sentence) is not None
        and not _MARKUP.search(sentence)
        and not _PRICE_LIKE.search(sentence)
        and not _FACT_WORDS.search(sentence)
    )


@functools.cache
def _prose(directory: Path) -> tuple[tuple[str, bool], ...]:
    """The prose's sentences in reading order, each with whether it ends its paragraph."""
    sentences: list[tuple[str, bool]] = []
    seen: set[str] = set()
    for name in PROSE_FILES:
        path = directory / name
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT,
                f"prose filler needs {path}, which Debian's {PROSE_PACKAGE} package installs "
                f"(apt-get install --reinstall {PROSE_PACKAGE})",
                str(path),
            ) from None
        for block in _PARAGRAPH_BREAK.split(text):
            paragraph = _NUMBERING.sub("", " ".join(block.split()))
            kept = [s for s in _SENTENCE_BREAK.split(paragraph) if _is_prose(s) and s not in seen]
            seen.update(kept)
            sentences += [(s, i == len(kept) - 1) for i, s in enumerate(kept)]
    return tuple(sentences)


def _prose_document(
    rng: random.Random,
    facts: list[Fact],
    filler: int,
    prose: tuple[tuple[str, bool], ...],
    start: int,
) -> str:
    """``filler`` consecutive sentences of the prose from ``start`` (wrapping round), the
    facts inserted between them at random places; paragraphs stay one a line."""
    window = [prose[(start + i) % len(prose)] for i in range(filler)]
    for fact in facts:
        window.insert(rng.randint(0, len(window)), (fact.sentence, False))
    return "".join(s + ("\n" if ends else " ") for s, ends in window).strip()


# Tokens a document takes (Qwen2.5's tokenizer, the means of 960 documents): its two facts
# and the separator, and each filler sentence (prose, templated).
FACT_TOKENS, PROSE_SENTENCE_TOKENS, TEMPLATED_SENTENCE_TOKENS = 20, 29.5, 10.0


def filler_for(doc_tokens: int, prose: bool) -> int:
    """The filler sentences that make documents of about ``doc_tokens`` tokens (at least 1):
    with prose 1 -> ~49 tokens, 3 -> ~106, 6 -> ~194, 9 -> ~283, 16 -> ~493."""
    per = PROSE_SENTENCE_TOKENS if prose else TEMPLATED_SENTENCE_TOKENS
    return max(1, round((doc_tokens - FACT_TOKENS) / per))


def generate(
    cases: int,
    seed: int = 0,
    pool_docs: int = 40,
    docs_per_case: int = 5,
    filler: int = 2,
    prose: bool = False,
    split: str = TUNE,
) -> list[Case]:
    """``cases`` cases over a pool of ``pool_docs`` documents (two facts and ``filler``
    sentences that answer nothing each: templated ones, or real prose with ``prose``).
    A document of ~500 tokens takes ``filler=48`` templated sentences, or 16 of prose
    (``filler_for``). ``split``: TUNE, or HELDOUT for other people, templated sentences and
    seeds (prose from the same texts, at the windows another seed draws).

    Raises ``FileNotFoundError`` naming the file and its package where ``prose`` is asked
    for and the prose is not on this machine, ValueError on an unknown split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    rng = random.Random(seed + (HELDOUT_SEED if split == HELDOUT else 0))
    facts = _facts(rng, 2 * pool_docs, split)
    by_doc = [facts[2 * i : 2 * i + 2] for i in range(pool_docs)]
    if prose:
        sentences = _prose(PROSE_DIR)
        # Evenly spaced starts: documents share no prose while the pool's windows fit in it.
        base = rng.randrange(len(sentences))
        starts = [
            (base + i * len(sentences) // pool_docs) % len(sentences) for i in range(pool_docs)
        ]
        rng.shuffle(starts)
        texts = [
            _prose_document(rng, doc_facts, filler, sentences, start)
            for doc_facts, start in zip(by_doc, starts, strict=True)
        ]
    else:
        templated = HELDOUT_FILLER if split == HELDOUT else FILLER
        texts = [_document(rng, doc_facts, filler, templated) for doc_facts in by_doc]
    out: list[Case] = []
    kinds = ("one", "two", "distracted")
    while len(out) < cases:
        kind = kinds[len(out) % 3]
        picked = rng.sample(range(pool_docs), docs_per_case)
        docs = tuple(texts[i] for i in picked)
        if kind == "two":
            slots = tuple(rng.sample(range(docs_per_case), 2))
            a, b = (rng.choice(by_doc[picked[slot]]) for slot in slots)
            question = f"{a.question} And {b.question[0].lower()}{b.question[1:]}"
            out.append(Case(kind, docs, question, (a.answer, b.answer), slots))
            continue
        slot = rng.randrange(docs_per_case)
        target = rng.choice(by_doc[picked[slot]])
        if kind == "distracted":
            others = [i for s, i in enumerate(picked) if s != slot]
            if not any(f.kind == target.kind for i in others for f in by_doc[i]):
                continue  # no distractor among these documents: draw again
        out.append(Case(kind, docs, target.question, (target.answer,), (slot,)))
    return out


# A long document states a fact about every LONG_FACT_SPACING tokens of its prose.
LONG_FACT_SPACING = 300


def long_cases(documents: int, doc_tokens: int, questions: int, seed: int = 0) -> list[Case]:
    """``questions`` cases on each of ``documents`` long documents of about ``doc_tokens``
    tokens (``chunkstore bench long``): consecutive prose sentences from a seeded place
    (wrapping round: past ~16k tokens the prose repeats) with a fact every
    ``LONG_FACT_SPACING`` tokens or so, at random places; every fact has look-alikes (a third
    of them are of each kind), so a question is a needle among same-kind keys (RULER's
    multi-key). Cases alternate ``one`` (a fact) and ``two`` (two facts, both in the answer);
    a document's questions ask about different facts while it has them. Each case's
    ``documents`` is its one document; cases of a document follow each other.

    Raises ``FileNotFoundError`` as ``generate`` does without the prose."""
    if documents < 1 or questions < 1:
        raise ValueError("long cases need at least one document and one question")
    rng = random.Random(seed)
    sentences = _prose(PROSE_DIR)
    count = max(4, doc_tokens // LONG_FACT_SPACING)
    filler = max(1, round((doc_tokens - count * FACT_TOKENS / 2) / PROSE_SENTENCE_TOKENS))
    out: list[Case] = []
    for _ in range(documents):
        facts = _facts(rng, count)
        text = _prose_document(rng, facts, filler, sentences, rng.randrange(len(sentences)))
        unasked = rng.sample(facts, len(facts))
        for index in range(questions):
            if len(unasked) < 2:
                unasked = rng.sample(facts, len(facts))
            if index % 2:
                a, b = unasked.pop(), unasked.pop()
                question = f"{a.question} And {b.question[0].lower()}{b.question[1:]}"
                out.append(Case("two", (text,), question, (a.answer, b.answer), (0,)))
            else:
                fact = unasked.pop()
                out.append(Case("one", (text,), fact.question, (fact.answer,), (0,)))
    return out
