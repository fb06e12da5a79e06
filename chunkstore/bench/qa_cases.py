"""Generated multi-document QA cases for ``chunkstore bench quality``: seeded, so runs compare.

A pool of short documents, each stating two facts about people or things among filler
sentences; every fact is unique in the pool, and every document's facts have look-alikes in
other documents (the same kind of fact about someone else: distractors). A case puts
``docs_per_case`` documents of the pool in random order and asks one of three kinds of
question:
- ``one``: a fact stated in one of its documents;
- ``two``: two facts stated in two different documents, both needed in the answer;
- ``distracted``: a fact whose look-alike about another entity is also in the case.
The documents holding the answer stand at uniformly random slots of the case, and the case
says which (``Case.relevant``), so a bench can rank chunks by position, by relevance to the
question, or by that oracle. Cases share documents, so a store warmed by earlier cases
serves later ones.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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


def _facts(rng: random.Random, count: int) -> list[Fact]:
    people = [f"{f} {la}" for f in FIRST for la in LAST]
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


def _document(rng: random.Random, facts: list[Fact], filler: int) -> str:
    few = filler <= len(FILLER)  # distinct sentences while there are enough
    padding = rng.sample(FILLER, filler) if few else rng.choices(FILLER, k=filler)
    sentences = [f.sentence for f in facts] + padding
    rng.shuffle(sentences)
    return " ".join(sentences)


def generate(
    cases: int, seed: int = 0, pool_docs: int = 40, docs_per_case: int = 5, filler: int = 2
) -> list[Case]:
    """``cases`` cases over a pool of ``pool_docs`` documents (two facts and ``filler``
    sentences that answer nothing each)."""
    rng = random.Random(seed)
    facts = _facts(rng, 2 * pool_docs)
    by_doc = [facts[2 * i : 2 * i + 2] for i in range(pool_docs)]
    texts = [_document(rng, doc_facts, filler) for doc_facts in by_doc]
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
