"""The SQLite database of a small online shop, built deterministically from a seed.

Four tables: 60 customers, 40 products, 250 orders and their line items (about 600),
all from ``random.Random(seed)``, so the same seed always gives the same rows.
"""

from __future__ import annotations

import os
import random
import sqlite3
import tempfile
from pathlib import Path

SCHEMA = """\
CREATE TABLE customers (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    city TEXT NOT NULL,
    signup_year INTEGER NOT NULL
);
CREATE TABLE products (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    category TEXT NOT NULL,
    price INTEGER NOT NULL  -- whole dollars
);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL REFERENCES customers(id),
    order_date TEXT NOT NULL,  -- 'YYYY-MM-DD'
    status TEXT NOT NULL  -- 'delivered', 'shipped' or 'cancelled'
);
CREATE TABLE order_items (
    order_id INTEGER NOT NULL REFERENCES orders(id),
    product_id INTEGER NOT NULL REFERENCES products(id),
    quantity INTEGER NOT NULL,
    PRIMARY KEY (order_id, product_id)
);
"""

TABLES = ("customers", "products", "orders", "order_items")

FIRST_NAMES = [
    "Ava", "Ben", "Chloe", "Dev", "Elif", "Farah", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lucia",
    "Mateo", "Nia", "Oskar", "Pia", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Viktor", "Wen", "Yusuf",
]
LAST_NAMES = [
    "Lindqvist", "Okafor", "Moreau", "Tanaka", "Novak", "Haddad", "Ferreira", "Kowalski", "Nguyen",
    "Brennan", "Castillo", "Ivanova", "Sato", "Mensah", "Larsen", "Costa",
]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Osaka", "Denver", "Krakow", "Lima", "Perth"]
CATEGORIES = {
    "kitchen": ["Kettle", "Chef Knife", "Cutting Board", "Pepper Mill", "Teapot", "Frying Pan", "Whisk",
                "Colander"],
    "garden": ["Hose Reel", "Pruning Shears", "Watering Can", "Trowel", "Seed Tray", "Garden Gloves", "Rake",
               "Planter"],
    "office": ["Desk Lamp", "Stapler", "Notebook", "Fountain Pen", "Monitor Stand", "Desk Chair", "Whiteboard",
               "Paper Tray"],
    "outdoor": ["Tent", "Sleeping Bag", "Camp Stove", "Headlamp", "Backpack", "Water Filter", "Trekking Poles",
                "Cooler"],
    "audio": ["Headphones", "Speaker", "Turntable", "Microphone", "Earbuds", "Amplifier", "Radio", "Soundbar"],
}
PRODUCT_BRANDS = ["Nordvik", "Altura", "Bramble", "Corvo", "Delta", "Everly", "Fjell", "Granite"]
STATUSES = ("delivered", "shipped", "cancelled")
STATUS_WEIGHTS = (0.7, 0.15, 0.15)
YEARS = (2022, 2023, 2024)
DAYS_IN_MONTH = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)

N_CUSTOMERS = 60
N_PRODUCTS = 40
N_ORDERS = 250


def _rows(seed: int) -> dict[str, list[tuple]]:
    rng = random.Random(seed)
    names = [f"{f} {l}" for f in FIRST_NAMES for l in LAST_NAMES]
    customers = [
        (i + 1, name, rng.choice(CITIES), rng.choice((2019, 2020, 2021, 2022, 2023)))
        for i, name in enumerate(rng.sample(names, N_CUSTOMERS))
    ]

    catalogue = [(cat, item) for cat, items in CATEGORIES.items() for item in items]
    products = []
    for i, (cat, item) in enumerate(rng.sample(catalogue, N_PRODUCTS)):
        price = rng.randint(5, 120) if cat in ("kitchen", "garden", "office") else rng.randint(20, 400)
        products.append((i + 1, f"{rng.choice(PRODUCT_BRANDS)} {item}", cat, price))

    orders, items = [], []
    for order_id in range(1, N_ORDERS + 1):
        year, month = rng.choice(YEARS), rng.randint(1, 12)
        day = rng.randint(1, DAYS_IN_MONTH[month - 1])
        status = rng.choices(STATUSES, STATUS_WEIGHTS)[0]
        orders.append((order_id, rng.randint(1, N_CUSTOMERS), f"{year:04d}-{month:02d}-{day:02d}", status))
        for product_id in sorted(rng.sample(range(1, N_PRODUCTS + 1), rng.randint(1, 4))):
            items.append((order_id, product_id, rng.randint(1, 5)))
    return {"customers": customers, "products": products, "orders": orders, "order_items": items}


def build_database(path: str | os.PathLike, seed: int) -> Path:
    """Write the shop database for ``seed`` to ``path`` (replacing it atomically) and return its absolute path.

    The file is built under a temporary name and renamed into place, so a reader never
    sees a half-written database, even when several processes build the same one.
    """
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = _rows(seed)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp)
        try:
            conn.executescript(SCHEMA)
            for table in TABLES:
                width = len(rows[table][0])
                conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * width)})", rows[table])
            conn.commit()
        finally:
            conn.close()
        os.chmod(tmp, 0o644)  # mkstemp makes the file private; rollout workers may run as other users
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_table(path: str | os.PathLike, table: str) -> list[tuple]:
    """All rows of one table, ordered by rowid (used to check answers independently of the questions' SQL)."""
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; tables: {', '.join(TABLES)}")
    conn = sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True)
    try:
        return conn.execute(f"SELECT * FROM {table} ORDER BY rowid").fetchall()
    finally:
        conn.close()
