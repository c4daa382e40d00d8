"""bench/goals.py's verdicts and exit status, from SUMMARY lines as the benchmarks print them:
`make bench-goals` must fail when a goal is missed."""

from __future__ import annotations

from goals import exit_code, verdicts

ROUNDTRIP = ("SUMMARY rest/direct={rest}x rest/stock_direct=0.90x rest_httpx/direct=1.20x mcp/direct={mcp}x "
             "stock_kg/direct=6.0x tool_call=1.700ms (median ms: direct=7.0)")


def test_every_goal_met_exits_0() -> None:
    rows = verdicts({"roundtrip": ROUNDTRIP.format(rest="1.10", mcp="1.50")})
    assert [r[2] for r in rows] == ["met", "met", "met"]
    assert exit_code(rows) == 0


def test_a_missed_goal_exits_non_zero() -> None:
    rows = verdicts({"roundtrip": ROUNDTRIP.format(rest="1.35", mcp="1.50")})
    assert ("REST warm execute <= 1.2x direct (tuned like kernelmode's kernels)", "1.35x", "NOT met",
            "roundtrip") in rows
    assert exit_code(rows) == 1


def test_the_tuned_ratio_is_the_goal_not_the_stock_one() -> None:
    """rest/stock_direct (a stock ipykernel, for context) never stands in for rest/direct."""
    rows = verdicts({"roundtrip": ROUNDTRIP.format(rest="1.30", mcp="1.50")})
    assert rows[0][1:3] == ("1.30x", "NOT met")


def test_a_benchmark_without_a_figure_exits_non_zero() -> None:
    rows = verdicts({"roundtrip": "", "realistic": "SUMMARY groupby: a / b = 1.10x figure: c / d = 1.30x"})
    assert {r[2] for r in rows if r[3] == "roundtrip"} == {"no figure"}
    assert {r[2] for r in rows if r[3] == "realistic"} == {"figure"}  # figures only: never a miss
    assert exit_code(rows) == 1
    assert exit_code([r for r in rows if r[3] == "realistic"]) == 0
