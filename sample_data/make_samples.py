"""Generate the labelled sample tables used by `pipelines/*.yaml` and the accuracy benchmark.

Run from the repository root: `python sample_data/make_samples.py` (fixed seed: the output is identical on
every run). Each table has an `id` column, the raw input column(s) a pipeline reads, and label columns
(prefixed `label_` or named `label`) holding the value a perfect model would produce.
"""
from __future__ import annotations

import csv
import random
from datetime import date, timedelta
from pathlib import Path

from sample_vocab import (
    CITIES_UK, CITIES_US, FIRST, LAST, PRODUCTS, TICKET_BILLING, TICKET_BUG, TICKET_OTHER, VENDORS,
)

SEED = 20261129
ROWS = 240
HERE = Path(__file__).resolve().parent
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]


def _write(name: str, rows: list[dict]) -> None:
    with open(HERE / name, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _fmt_date(rng: random.Random, d: date, style: str | None = None) -> str:
    style = style or rng.choice(["iso", "long", "us", "short", "ordinal"])
    if style == "iso":
        return d.isoformat()
    if style == "long":
        return f"{d.day} {MONTHS[d.month - 1]} {d.year}"
    if style == "us":
        return f"{d.month:02d}/{d.day:02d}/{d.year}"
    if style == "short":
        return f"{d.day} {MONTHS[d.month - 1][:3]} {d.year % 100:02d}"
    return f"{MONTHS[d.month - 1]} {_ordinal(d.day)}, {d.year}"


def _money(rng: random.Random, amount: float, currency: str) -> str:
    plain = f"{amount:,.2f}"
    symbol = {"USD": "$", "EUR": "€", "GBP": "£"}[currency]
    return rng.choice([f"{symbol}{plain}", f"{currency} {plain}", f"{plain} {currency}", f"{symbol} {plain}"])


def invoices(rng: random.Random) -> list[dict]:
    openers = ["Hi team,", "Hello,", "Dear Accounts Payable,", "Good morning,", "Hi there,", "Dear customer,"]
    rows = []
    for i in range(ROWS):
        vendor = rng.choice(VENDORS)
        currency = rng.choices(["USD", "EUR", "GBP"], weights=[5, 3, 2])[0]
        amount = round(rng.uniform(12, 9800) if rng.random() < 0.85 else rng.uniform(10000, 48000), 2)
        number = rng.choice([
            f"INV-{rng.randint(2023, 2026)}-{rng.randint(1, 9999):04d}", f"{rng.randint(100000, 999999)}",
            f"{vendor[:2].upper()}{rng.randint(1000, 99999)}", f"INV{rng.randint(10000, 99999)}",
            f"{rng.choice('ABCDEFGH')}-{rng.randint(100, 99999)}",
        ])
        issued = date(2025, 1, 1) + timedelta(days=rng.randint(0, 420))
        due = issued + timedelta(days=rng.choice([7, 14, 15, 30, 30, 45, 60]))
        po = f"PO-{rng.randint(10000, 99999)}"
        money, due_s = _money(rng, amount, currency), _fmt_date(rng, due)
        body = rng.choice([
            f"{rng.choice(openers)} Please find attached invoice {number} from {vendor} for {money}. "
            f"Payment is due by {due_s}. Reference your purchase order {po} when paying.",
            f"{rng.choice(openers)} Invoice #{number} ({vendor}) totalling {money} was issued on "
            f"{_fmt_date(rng, issued)}. Kindly settle it before {due_s}.",
            f"{vendor} - invoice {number}. Amount due: {money}. Due date: {due_s}. "
            f"Thank you for your business!",
            f"Reminder: our records show invoice {number} for {money} is still open. It falls due on "
            f"{due_s}. Questions? Reply to billing@{vendor.split()[0].lower()}.com. - {vendor}",
            f"{rng.choice(openers)} This is {vendor}'s billing team. We have raised invoice {number} "
            f"against {po}. Total payable {money}, due {due_s}. Bank details are on the PDF.",
        ])
        rows.append(dict(id=i + 1, vendor=vendor, body=body, label_invoice_number=number,
                         label_total_amount=f"{amount:.2f}", label_currency=currency,
                         label_due_date=due.isoformat()))
    return rows


def _messy_name(rng: random.Random, first: str, last: str) -> str:
    style = rng.randrange(6)
    name = [f"{first} {last}", f"{last}, {first}", f"{first.upper()} {last.upper()}",
            f"{first.lower()} {last.lower()}", f"  {first} {last} ", f"{first.swapcase()} {last}"][style]
    return name


def _messy_phone(rng: random.Random, country: str) -> tuple[str, str]:
    if country == "US":
        a, b, c = rng.randint(201, 989), rng.randint(200, 999), rng.randint(0, 9999)
        raw = rng.choice([f"({a}) {b}-{c:04d}", f"{a}.{b}.{c:04d}", f"+1 {a} {b} {c:04d}", f"{a}{b}{c:04d}",
                          f"1-{a}-{b}-{c:04d}", f"{a}-{b}-{c:04d}"])
        return raw, f"+1{a}{b}{c:04d}"
    area, rest = rng.choice(["20", "161", "131", "117", "121"]), rng.randint(1000000, 9999999)
    digits = f"{area}{rest}"[:10]
    raw = rng.choice([f"0{digits[:len(area)]} {digits[len(area):]}", f"+44 {digits}", f"0{digits}",
                      f"(0{area}) {digits[len(area):]}", f"+44 (0){area} {digits[len(area):]}"])
    return raw, f"+44{digits}"


def _messy_weight(rng: random.Random) -> tuple[str, str]:
    kg = round(rng.uniform(48, 118), 1)
    lbs = round(kg / 0.45359237)
    unit = rng.randrange(5)
    if unit == 0:
        return f"{kg} kg", f"{kg:.1f}"
    if unit == 1:
        return f"{kg:g}kg", f"{kg:.1f}"
    if unit == 2:
        return f"{lbs} lbs", f"{lbs * 0.45359237:.1f}"
    if unit == 3:
        return f"{lbs} pounds", f"{lbs * 0.45359237:.1f}"
    return f"{kg:g} kilograms", f"{kg:.1f}"


def customers(rng: random.Random) -> list[dict]:
    rows = []
    for i in range(ROWS):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        country = rng.choices(["US", "UK"], weights=[3, 2])[0]
        signup = date(2019, 1, 1) + timedelta(days=rng.randint(0, 2500))
        style = rng.choice(["iso", "long", "short", "ordinal", "local"])
        if style == "local":
            signup_s = (f"{signup.month}/{signup.day}/{signup.year}" if country == "US"
                        else f"{signup.day:02d}/{signup.month:02d}/{signup.year}")
        else:
            signup_s = _fmt_date(rng, signup, style)
        phone, phone_clean = _messy_phone(rng, country)
        weight, weight_kg = _messy_weight(rng)
        city = rng.choice(CITIES_US if country == "US" else CITIES_UK)
        city_raw = rng.choice([city, city.upper(), city.lower(), f" {city}"])
        rows.append(dict(id=i + 1, name=_messy_name(rng, first, last), country=country, city=city_raw,
                         signup_date=signup_s, phone=phone, weight=weight,
                         label_name=f"{first} {last}", label_city=city, label_signup_date=signup.isoformat(),
                         label_phone=phone_clean, label_weight_kg=weight_kg))
    return rows


def _variant(rng: random.Random, p: dict) -> str:
    brand, model, spec, color = p["brand"], p["model"], p["spec"], p["color"]
    return rng.choice([
        f"{brand} {model} {spec} {color}", f"{model} ({spec}) - {color}, {brand}",
        f"{brand.upper()} {model} {spec.replace(' ', '')} - {color}", f"{model} {spec} {color} by {brand}",
        f"New {brand} {model}, {spec}, {color.lower()}", f"{brand} {model} - {color} - {spec}",
    ])


def product_pairs(rng: random.Random) -> list[dict]:
    rows = []
    for i in range(ROWS):
        left = rng.choice(PRODUCTS)
        kind = rng.choices(["match", "near", "far"], weights=[5, 3, 2])[0]
        if kind == "match":
            right = left
        elif kind == "near":
            same_model = [p for p in PRODUCTS if p["model"] == left["model"] and p != left]
            same_brand = [p for p in PRODUCTS if p["brand"] == left["brand"] and p != left]
            right = rng.choice(same_model or same_brand or [p for p in PRODUCTS if p != left])
        else:
            right = rng.choice([p for p in PRODUCTS if p["brand"] != left["brand"]])
        price = left["price"]
        rows.append(dict(id=i + 1, left_title=_variant(rng, left), left_price=f"{price:.2f}",
                         right_title=_variant(rng, right),
                         right_price=f"{right['price'] * rng.uniform(0.9, 1.1):.2f}",
                         label="match" if right == left else "no_match"))
    return rows


def tickets(rng: random.Random) -> list[dict]:
    pools = {"bug": TICKET_BUG, "billing": TICKET_BILLING, "other": TICKET_OTHER}
    fills = dict(
        feature=["the export button", "search", "the dashboard", "CSV import", "the mobile app", "login",
                 "two-factor authentication", "the reports page", "notifications", "file upload"],
        plan=["Pro", "Team", "Business", "Starter", "Enterprise"],
        amount=["$49.00", "$199.00", "$12.99", "€89.00", "£25.00", "$1,200.00"],
        month=MONTHS,
        browser=["Chrome 131", "Firefox 133", "Safari 18", "Edge 131", "the iOS app", "the Android app"],
        error=["500 Internal Server Error", "a blank white page", "'Something went wrong'", "a spinner forever",
               "ERR_CONNECTION_RESET", "'null is not an object'"],
    )
    rows = []
    for i in range(ROWS):
        label = rng.choices(["bug", "billing", "other"], weights=[4, 3, 3])[0]
        subject, body = rng.choice(pools[label])
        values = {k: rng.choice(v) for k, v in fills.items()}
        customer = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        rows.append(dict(id=i + 1, customer=customer, subject=subject.format(**values),
                         body=body.format(**values), label=label))
    return rows


def main() -> None:
    rng = random.Random(SEED)
    _write("invoices.csv", invoices(rng))
    _write("customers_messy.csv", customers(rng))
    _write("products_pairs.csv", product_pairs(rng))
    _write("tickets.csv", tickets(rng))


if __name__ == "__main__":
    main()
