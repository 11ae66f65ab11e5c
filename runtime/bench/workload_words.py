"""The word lists and seeded fill-ins the benchmark workloads (workloads.py) are built from.

Changing a list changes every generated workload: the generators' outputs are pinned by tests/bench.
"""

from __future__ import annotations

import random
from typing import Any

PEOPLE = [
    "Amara", "Bastian", "Carmen", "Dmitri", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kiri",
    "Lorenzo", "Mei", "Nils", "Olufemi", "Paloma", "Rafael", "Saoirse", "Tomasz", "Uma", "Viktor",
    "Wanjiru", "Yara", "Zeno",
]
TOWNS = [
    "Northvale", "Kestrel Bay", "Amberfield", "Old Harrow", "Quarry Hill", "Fenwick", "Saltmarsh",
    "Bramblewood", "Copper Ridge", "Lindenford", "Wrenmouth", "Gull Point", "Marrowgate", "Highmoor",
    "Tansy Cross", "Eldergate",
]
SHOPS = ["bakery", "hardware store", "bookshop", "flower stall", "corner shop", "pharmacy", "toy shop",
         "bicycle shop", "tea house", "print shop"]
GOODS = ["candles", "jars of honey", "notebooks", "bags of rice", "paint brushes", "light bulbs", "scarves",
         "tins of soup", "flower pots", "rolls of tape", "bars of soap", "batteries"]
CONTAINERS = ["crate", "carton", "basket", "drawer", "shelf", "sack"]
ROOMS = ["attic", "school hall", "waiting room", "garden shed", "museum gallery", "train carriage", "kitchen"]
THINGS = ["chairs", "windows", "umbrellas", "paintings", "potted plants", "lamps", "coats", "clocks"]
EVENTS = ["folk festival", "chess tournament", "book fair", "flower show", "night market", "boat race"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
VEHICLES = ["ferry", "night bus", "cargo train", "mail van", "river barge", "coach"]
OPPOSITES = [("heavy", "light"), ("narrow", "wide"), ("ancient", "modern"), ("noisy", "quiet"),
             ("early", "late"), ("shallow", "deep"), ("rough", "smooth"), ("generous", "mean"),
             ("empty", "full"), ("fragile", "sturdy"), ("dim", "bright"), ("tidy", "messy")]
OPPOSITE_NOUNS = ["parcel", "corridor", "bridge", "cellar", "morning", "river", "path", "visitor", "cupboard",
                  "vase", "lantern", "desk"]
JOBS = ["locksmith", "midwife", "surveyor", "tailor", "beekeeper", "ferry captain", "archivist", "welder",
        "florist", "radio host", "glazier", "veterinarian", "courier", "stage manager", "cartographer"]
TRAITS = ["reluctant", "meticulous", "absent-minded", "soft-spoken", "ambitious", "superstitious",
          "good-natured", "secretive", "impatient", "stubborn", "wry", "restless"]
WEATHER = ["foggy", "stormy", "unusually warm", "freezing", "damp", "windy"]
SEASONS = ["spring", "summer", "autumn", "winter"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def words(rng: random.Random) -> dict[str, Any]:
    """One random value for every placeholder the templates below may use."""
    return {"person": rng.choice(PEOPLE), "town": rng.choice(TOWNS), "job": rng.choice(JOBS),
            "trait": rng.choice(TRAITS), "weather": rng.choice(WEATHER), "season": rng.choice(SEASONS),
            "weekday": rng.choice(WEEKDAYS), "shop": rng.choice(SHOPS), "goods": rng.choice(GOODS),
            "room": rng.choice(ROOMS), "things": rng.choice(THINGS), "k": rng.randint(2, 6)}


def fill(rng: random.Random, template: str) -> str:
    return template.format(**words(rng))


def seeded_rng(name: str, seed: int) -> random.Random:
    # A string seed is hashed with SHA-512 by random.Random: stable across runs, machines and versions.
    return random.Random(f"radixserve-bench/{name}/{seed}")
