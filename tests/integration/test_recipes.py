"""The documented automation recipe (docs/automation.md), run as the plain-HTTP script it ships as."""

from __future__ import annotations

import os
import subprocess

from tests.conftest import REPO, Server


def test_http_recipe_script(server: Server, tmp_path) -> None:
    env = {**os.environ, "KERNELMODE_URL": server.url, "KERNELMODE_TOKEN": server.token, "OUT_DIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(REPO / "examples" / "http_recipe.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "status: ok  total: 245" in proc.stdout
    assert (tmp_path / "report.csv").read_text().splitlines() == [
        "region,amount", "east,45", "south,80", "north,120"]
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The script's trap deleted its session.
    with server.client() as api:
        sid = proc.stdout.split("session: ", 1)[1].split()[0]
        assert api.get(f"/v1/sessions/{sid}").status_code == 404
