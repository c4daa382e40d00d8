"""bench/harness.py's writers of bench/RESULTS.md: a benchmark's rewrite keeps everyone else's text."""

from __future__ import annotations

from pathlib import Path

import harness


def test_the_page_head_is_replaced_and_everything_after_it_kept(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# old head\n\nold figures\n")
    harness.write_section(results, "load", "## Load\nfigures")
    with results.open("a") as f:
        f.write("\n## A hand-written note between sections\nkept\n")
    harness.write_section(results, "other", "## Other\nmore")
    harness.write_page(results, "# new head\n\nnew figures\n")
    text = results.read_text()
    assert text.startswith("# new head\n\nnew figures\n") and "old figures" not in text
    for kept in ("## Load\nfigures", "## A hand-written note between sections\nkept", "## Other\nmore"):
        assert kept in text, text
    assert text.index("## Load") < text.index("hand-written") < text.index("## Other")


def test_a_page_without_sections_is_the_new_head_only(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    harness.write_page(results, "# head\n")
    assert results.read_text() == "# head\n"
    results.write_text("# old\n")
    harness.write_page(results, "# head\n")
    assert results.read_text() == "# head\n"
