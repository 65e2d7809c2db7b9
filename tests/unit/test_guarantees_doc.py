"""docs/guarantees.md names, for each guarantee, the test that proves it: every test it names
exists (so a renamed or deleted test cannot leave the page pointing at nothing)."""

from __future__ import annotations

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def test_every_test_the_guarantees_page_names_exists():
    page = (ROOT / "docs" / "guarantees.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", page)
    assert len(named) >= 50
    missing = []
    for path, name in named:
        f = ROOT / path
        if not f.is_file() or not re.search(rf"^(async )?def {name}\(", f.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert missing == []
