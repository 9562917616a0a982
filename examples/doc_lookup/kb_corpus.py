"""A synthetic knowledge base: 200 short articles about fictional cities, companies and products.

The corpus is a pure function of its seed (``CORPUS_SEED`` by default), so the dataset
generator and the agent rebuild exactly the same articles in memory without sharing a
file. Every article states several facts; each fact comes with a question that names
the article's subject, so it is answerable from that one article.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

CORPUS_SEED = 0
N_CITIES, N_COMPANIES, N_PRODUCTS = 70, 60, 70

FIRST_NAMES = [
    "Ada", "Bram", "Cora", "Dmitri", "Esme", "Felix", "Greta", "Hugo", "Ines", "Jasper", "Kira", "Lorenz",
    "Mirela", "Nils", "Odile", "Piet", "Rhea", "Silas", "Thea", "Ulrich", "Vera", "Wim", "Xenia", "Yannick",
    "Zora", "Anouk", "Basil", "Celeste", "Dorian", "Elodie",
]
LAST_NAMES = [
    "Quist", "Marlow", "Okonkwo", "Vantreight", "Halloran", "Szabo", "Lindgren", "Achterberg", "Petrossian",
    "Delacroix", "Ferreira", "Nakashima", "Whitlock", "Brankovic", "Oyelaran", "Castellanos", "Thorvald",
    "Mbeki", "Rasmussen", "Iwasaki", "Kowalczyk", "Abernathy", "Valdivia", "Haugen", "Sorensen", "Tuominen",
    "Ellery", "Moravec", "Galloway", "Pellegrini",
]
ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "th", "v", "z"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "ou"]
CODAS = ["n", "r", "l", "s", "th", "m", "x", "nd"]
CITY_SUFFIXES = ["holt", "mere", "vik", "ford", "haven", "dale", "port", "stead", "wick", "burg"]
INDUSTRIES = ["Instruments", "Foods", "Textiles", "Robotics", "Shipping", "Ceramics", "Optics", "Analytics",
              "Motors", "Acoustics"]
CITY_TRADES = ["glassblowing", "shipbuilding", "clockmaking", "weaving", "printing", "cheesemaking", "tanning",
               "bell casting"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
PRODUCT_KINDS = ["handheld scanner", "espresso machine", "electric bicycle", "drone", "smartwatch", "desk lamp",
                 "water purifier", "portable projector", "robot vacuum", "synthesizer"]
COLORS = ["slate grey", "coral red", "forest green", "midnight blue", "sand beige", "copper orange", "pearl white",
          "plum purple"]
FEATURES = ["long battery life", "quiet motor", "sturdy frame", "bright display", "simple controls",
            "fast charging"]
MODEL_TAGS = ["100", "200", "300", "500", "X1", "X2", "Pro", "Mini", "Max", "S"]


@dataclass(frozen=True)
class Fact:
    """One question answerable from an article, and its answer exactly as the article states it."""

    attribute: str
    question: str
    answer: str


@dataclass(frozen=True)
class Article:
    doc_id: str
    title: str
    kind: str
    text: str
    facts: tuple[Fact, ...]


class _Names:
    """Unique made-up names: no two subjects share a word, so a question's subject is unambiguous."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used = {w.lower() for w in FIRST_NAMES + LAST_NAMES}
        self.people: set[str] = set()

    def word(self, syllables: int) -> str:
        while True:
            parts = [self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(syllables)]
            word = ("".join(parts) + self.rng.choice(CODAS)).capitalize()
            if word.lower() not in self.used:
                self.used.add(word.lower())
                return word

    def city(self) -> str:
        while True:
            stem = "".join(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(self.rng.randint(1, 2)))
            name = (stem + self.rng.choice(CITY_SUFFIXES)).capitalize()
            if name.lower() not in self.used:
                self.used.add(name.lower())
                return name

    def person(self) -> str:
        while True:
            name = f"{self.rng.choice(FIRST_NAMES)} {self.rng.choice(LAST_NAMES)}"
            if name not in self.people:
                self.people.add(name)
                return name


def _city_article(rng: random.Random, names: _Names, city: str) -> tuple[str, tuple[Fact, ...]]:
    province, festival = names.word(2), names.word(2)
    founded, founder, mayor = rng.randint(1100, 1900), names.person(), names.person()
    people = rng.randint(20, 9000) * 100
    size = "small" if people < 50_000 else "mid-sized" if people < 250_000 else "large"
    population = f"{people:,}"
    month, trade = rng.choice(MONTHS), rng.choice(CITY_TRADES)
    text = (
        f"{city} is a {size} city in the province of {province}. "
        f"It was founded in {founded} by {founder}, and today it has a population of {population}. "
        f"The city grew rich on {trade}, and its old {trade} quarter still draws visitors. "
        f"The current mayor of {city} is {mayor}. "
        f"Every year in {month} the city hosts the {festival} Festival, which fills the main square for a week."
    )
    facts = (
        Fact("founded", f"In what year was the city of {city} founded?", str(founded)),
        Fact("founder", f"Who founded the city of {city}?", founder),
        Fact("mayor", f"Who is the current mayor of {city}?", mayor),
        Fact("province", f"In which province is the city of {city}?", province),
        Fact("population", f"What is the population of the city of {city}?", population),
        Fact("festival_month", f"In which month does {city} host the {festival} Festival?", month),
    )
    return text, facts


def _company_article(rng: random.Random, names: _Names, company: str, city: str, flagship: str | None):
    founded, founder, ceo = rng.randint(1850, 2015), names.person(), names.person()
    employees = f"{rng.randint(3, 900) * 10:,}"
    industry = company.split()[-1].lower()
    text = (
        f"{company} is a company in the {industry} business, headquartered in {city}. "
        f"It was founded in {founded} by {founder}. "
        f"The company employs {employees} people, and its chief executive is {ceo}."
    )
    if flagship is not None:
        text += f" Its best-known product is the {flagship}, which it has sold for many years."
    facts = (
        Fact("founded", f"In what year was the company {company} founded?", str(founded)),
        Fact("founder", f"Who founded the company {company}?", founder),
        Fact("ceo", f"Who is the chief executive of {company}?", ceo),
        Fact("headquarters", f"In which city is {company} headquartered?", city),
        Fact("employees", f"How many people does {company} employ?", employees),
    )
    return text, facts


def _product_article(rng: random.Random, names: _Names, product: str, kind: str, maker: str):
    released, designer = rng.randint(1995, 2024), names.person()
    price, weight = rng.randint(20, 2500), rng.randint(150, 9000)
    color, feature = rng.choice(COLORS), rng.choice(FEATURES)
    text = (
        f"The {product} is {'an' if kind[0] in 'aeiou' else 'a'} {kind} made by {maker}. "
        f"It was released in {released} at a price of {price} credits. "
        f"It weighs {weight} grams and is sold only in {color}. "
        f"Reviewers praised its {feature}. "
        f"The lead designer of the {product} was {designer}."
    )
    facts = (
        Fact("maker", f"Which company makes the {product}?", maker),
        Fact("released", f"In what year was the {product} released?", str(released)),
        Fact("price", f"What was the price of the {product} in credits when it was released?", str(price)),
        Fact("weight", f"How many grams does the {product} weigh?", str(weight)),
        Fact("color", f"In which color is the {product} sold?", color),
        Fact("designer", f"Who was the lead designer of the {product}?", designer),
    )
    return text, facts


@functools.lru_cache(maxsize=4)
def build_corpus(seed: int = CORPUS_SEED) -> tuple[Article, ...]:
    """The articles for ``seed``, in a seed-shuffled order with ids doc-000, doc-001, ..."""
    rng = random.Random(seed)
    names = _Names(rng)
    cities = [names.city() for _ in range(N_CITIES)]
    companies = [f"{names.word(2)} {rng.choice(INDUSTRIES)}" for _ in range(N_COMPANIES)]
    products = [f"{names.word(2)} {rng.choice(MODEL_TAGS)}" for _ in range(N_PRODUCTS)]
    makers = [rng.choice(companies) for _ in products]

    drafts: list[tuple[str, str, str, tuple[Fact, ...]]] = []
    for city in cities:
        drafts.append((city, "city", *_city_article(rng, names, city)))
    for company in companies:
        own_products = [p for p, m in zip(products, makers) if m == company]
        flagship = rng.choice(own_products) if own_products else None
        drafts.append((company, "company", *_company_article(rng, names, company, rng.choice(cities), flagship)))
    for product, maker in zip(products, makers):
        drafts.append((product, "product", *_product_article(rng, names, product, rng.choice(PRODUCT_KINDS), maker)))
    rng.shuffle(drafts)
    return tuple(
        Article(doc_id=f"doc-{i:03d}", title=title, kind=kind, text=text, facts=facts)
        for i, (title, kind, text, facts) in enumerate(drafts)
    )
