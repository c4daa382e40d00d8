"""The rig's first proof: a session through the manager runs on a node behind EG."""

from __future__ import annotations


def test_one_plus_one_through_eg(served):
    with served.client() as c:
        r = c.post("/v1/sessions", json={"session_id": "smoke"})
        assert r.status_code == 201, r.text
        r = c.post("/v1/sessions/smoke/execute", json={"code": "1+1"})
        assert r.status_code == 200 and r.json()["result"] == "2", r.text
