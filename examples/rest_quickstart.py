"""Quickstart against a running `kernelmode serve` (make run): a session, three calls, cleanup.

    KERNELMODE_URL=http://127.0.0.1:8888 KERNELMODE_TOKEN=... python examples/rest_quickstart.py
"""

from __future__ import annotations

import os
import sys

import httpx

url = os.environ.get("KERNELMODE_URL", "http://127.0.0.1:8888")
token = os.environ.get("KERNELMODE_TOKEN")
if not token:
    sys.exit("set KERNELMODE_TOKEN to the token `kernelmode serve` printed")

with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as api:
    session = api.post("/v1/sessions", json={"ttl_seconds": 600}).raise_for_status().json()
    sid = session["session_id"]
    print("session", sid)
    try:
        run = api.post(f"/v1/sessions/{sid}/execute", json={"code": "import pandas as pd\n"
              "df = pd.DataFrame({'city': ['Paris', 'Lyon'], 'temp': [21, 24]})"}).json()
        print("1:", run["status"])
        run = api.post(f"/v1/sessions/{sid}/execute", json={"code": "float(df.temp.mean())"}).json()
        print("2:", run["status"], "->", run["result"])  # variables persist: df is still there
        run = api.post(f"/v1/sessions/{sid}/execute", json={"code": "df.nope"}).json()
        print("3:", run["status"], run["error"]["ename"], "-", run["error"]["evalue"])
    finally:
        api.delete(f"/v1/sessions/{sid}")
