"""kernelmode.mcp.open_connections: the /mcp front door's own table of open MCP connections (caps
per tenant and in all, owners, the idle countdown), kept without the SDK's private state."""

from __future__ import annotations

from kernelmode.mcp.open_connections import OpenConnections


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_caps_count_openings_in_flight_per_tenant_and_in_all() -> None:
    c = OpenConnections(max_total=3, max_per_tenant=2)
    assert c.admit("a") and c.admit("a")
    assert not c.admit("a")  # two openings in flight already hold alpha's cap
    assert c.admit("b")
    assert not c.admit("c")  # all three places held
    c.opened("s1", "a", plain=True)
    c.not_opened("a")  # its initialize failed: the place is free again
    assert c.admit("a")
    c.opened("s2", "a", plain=False)
    assert c.open_count("a") == 2 and c.open_count() == 2
    c.gone("s1")
    c.gone("s1")  # twice (DELETE answered, then a 404): counted once
    c.not_opened("b")
    assert c.admit("a") and c.admit("c")


def test_owner_and_plain_are_kept_per_connection() -> None:
    c = OpenConnections(10, 10)
    assert c.admit("a")
    c.opened("s", "a", plain=True)
    conn = c.get("s")
    assert conn is not None and conn.tenant == "a" and conn.plain
    assert c.get("other") is None and c.get(None) is None


def test_a_connection_idles_out_only_with_nothing_in_flight() -> None:
    clock = Clock()
    c = OpenConnections(10, 10, idle_seconds=60, clock=clock)
    c.admit("a")
    c.opened("s", "a", plain=True)
    clock.now += 59
    assert c.idle() == []
    with c.using("s"):
        clock.now += 600  # a long call (or an open GET stream) holds the connection
        assert c.idle() == []
    assert c.idle() == []  # the countdown starts again when the last request ends
    clock.now += 60
    assert c.idle() == [("s", "a")]
    with c.using("unknown"):  # a request on an id the table does not hold changes nothing
        pass
