"""Generate the labelled tables of the semantic operators (`resolve`, `llm_join`): run from the repository
root, `python sample_data/make_entity_samples.py` (fixed seed: identical output on every run).

- `customers_dupes.csv`: customer records with duplicates (1-4 records per person: name order, case and
  typos vary, the phone is formatted differently, mistyped (10%) or missing (15%), the city's case varies);
  `label_entity` is the person.
  Different people may share a name (a hard negative: other city, other phone).
- `products_left.csv` / `products_right.csv`: the two sides of `products_pairs.csv` as two shop tables
  (`id` is the pair's id on both sides); the labelled pairs are `products_pairs.csv`'s.
`customer_records(rng, entities)` is also what `benchmarks/accuracy/resolve_blocking.py` draws its 1,000 rows from.
"""
from __future__ import annotations

import csv
import random
from pathlib import Path

from make_samples import _messy_name, _write
from sample_vocab import CITIES_UK, CITIES_US, FIRST, LAST

SEED = 20261201
HERE = Path(__file__).resolve().parent


def _typo(rng: random.Random, text: str) -> str:
    """One dropped, doubled or swapped letter inside a word longer than 3 letters."""
    words = text.split(" ")
    long = [k for k, w in enumerate(words) if len(w) > 3]
    if not long:
        return text
    k = rng.choice(long)
    w, i = words[k], rng.randrange(1, len(words[k]) - 1)
    words[k] = rng.choice([w[:i] + w[i + 1:], w[:i] + w[i] + w[i:], w[:i - 1] + w[i] + w[i - 1] + w[i + 1:]])
    return " ".join(words)


def _phone(rng: random.Random, country: str, digits: str) -> str:
    if country == "US":
        a, b, c = digits[:3], digits[3:6], digits[6:]
        return rng.choice([f"({a}) {b}-{c}", f"{a}.{b}.{c}", f"+1 {a} {b} {c}", f"{a}{b}{c}", f"1-{a}-{b}-{c}"])
    return rng.choice([f"0{digits[:3]} {digits[3:]}", f"+44 {digits}", f"0{digits}", f"+44 (0){digits[:3]} {digits[3:]}"])


def customer_records(rng: random.Random, entities: int) -> list[dict]:
    """Records of `entities` people, 1-4 each, shuffled; ids 1..n."""
    rows = []
    for e in range(entities):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        country = rng.choices(["US", "UK"], weights=[3, 2])[0]
        city = rng.choice(CITIES_US if country == "US" else CITIES_UK)
        digits = "".join(str(rng.randrange(10)) for _ in range(10))
        for _ in range(rng.choices([1, 2, 3, 4], weights=[4, 3, 2, 1])[0]):
            name = _messy_name(rng, first, last).strip()
            if rng.random() < 0.3:
                name = _typo(rng, name)
            own = digits
            if rng.random() < 0.1:  # a mistyped digit
                k = rng.randrange(10)
                own = digits[:k] + str((int(digits[k]) + 1) % 10) + digits[k + 1:]
            phone = "" if rng.random() < 0.15 else _phone(rng, country, own)
            rows.append(dict(name=name, city=rng.choice([city, city.upper(), city.lower()]),
                             phone=phone, label_entity=e + 1))
    rng.shuffle(rows)
    return [{"id": i + 1, **r} for i, r in enumerate(rows)]


def product_sides() -> tuple[list[dict], list[dict]]:
    """products_pairs.csv split into its left and right listings (ids kept)."""
    with open(HERE / "products_pairs.csv", encoding="utf-8") as f:
        pairs = list(csv.DictReader(f))
    left = [{"id": p["id"], "title": p["left_title"], "price": p["left_price"]} for p in pairs]
    right = [{"id": p["id"], "title": p["right_title"], "price": p["right_price"]} for p in pairs]
    return left, right


def main() -> None:
    rng = random.Random(SEED)
    _write("customers_dupes.csv", customer_records(rng, 120))
    left, right = product_sides()
    _write("products_left.csv", left)
    _write("products_right.csv", right)


if __name__ == "__main__":
    main()
