"""The marketing analysis loop through the REST API: upload a CSV, summarise it over several
calls (variables persist), draw two charts, write a PDF report with reportlab, download it.

    KERNELMODE_URL=http://127.0.0.1:8888 KERNELMODE_TOKEN=... python examples/marketing_report.py [OUT.pdf]
"""

from __future__ import annotations

import os
import sys

import httpx

CSV = "month,channel,spend,revenue\n" + "\n".join(
    f"2026-{m:02d},{ch},{100 + 17 * m + 40 * i},{260 + 31 * m + 55 * i + (m % 3) * 20}"
    for m in range(1, 13) for i, ch in enumerate(["search", "social", "email"])
) + "\n"

STEPS = [
    # 1. load and summarise
    "import pandas as pd\n"
    "df = pd.read_csv('/mnt/data/campaigns.csv')\n"
    "by_channel = df.groupby('channel')[['spend', 'revenue']].sum()\n"
    "by_channel['roi'] = (by_channel.revenue / by_channel.spend).round(2)\n"
    "by_channel",
    # 2. two charts, saved and shown
    "import matplotlib.pyplot as plt\n"
    "ax = by_channel[['spend', 'revenue']].plot.bar(title='Spend and revenue by channel')\n"
    "ax.figure.savefig('by_channel.png', dpi=100, bbox_inches='tight'); plt.show()\n"
    "monthly = df.groupby('month').revenue.sum()\n"
    "ax = monthly.plot(title='Revenue by month', marker='o')\n"
    "ax.figure.savefig('monthly.png', dpi=100, bbox_inches='tight'); plt.show()",
    # 3. the PDF report
    "from reportlab.lib.pagesizes import A4\n"
    "from reportlab.platypus import Image, Paragraph, SimpleDocTemplate, Spacer, Table\n"
    "from reportlab.lib.styles import getSampleStyleSheet\n"
    "styles = getSampleStyleSheet()\n"
    "rows = [['channel', 'spend', 'revenue', 'roi']] + [[c, int(r.spend), int(r.revenue), r.roi] for c, r in by_channel.iterrows()]\n"
    "doc = SimpleDocTemplate('report.pdf', pagesize=A4)\n"
    "doc.build([Paragraph('Marketing report 2026', styles['Title']), Table(rows), Spacer(1, 12),\n"
    "           Image('by_channel.png', width=400, height=300), Image('monthly.png', width=400, height=300)])\n"
    "best = by_channel.roi.idxmax()\n"
    "f'best channel: {best} (roi {by_channel.roi.max()})'",
]


def main() -> int:
    url = os.environ.get("KERNELMODE_URL", "http://127.0.0.1:8888")
    token = os.environ.get("KERNELMODE_TOKEN") or sys.exit("set KERNELMODE_TOKEN")
    out = sys.argv[1] if len(sys.argv) > 1 else "report.pdf"
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as api:
        sid = api.post("/v1/sessions", json={}).raise_for_status().json()["session_id"]
        try:
            api.put(f"/v1/sessions/{sid}/files/campaigns.csv", content=CSV.encode()).raise_for_status()
            for i, code in enumerate(STEPS, 1):
                run = api.post(f"/v1/sessions/{sid}/execute", json={"code": code}).json()
                if run["status"] != "ok":
                    print(f"step {i} failed: {run['error']}", file=sys.stderr)
                    return 1
                names = ", ".join(a["name"] for a in run["artifacts"]) or "-"
                print(f"step {i}: ok; artifacts: {names}")
            print(run["result"])
            pdf = next(a for a in run["artifacts"] if a["name"] == "report.pdf")
            data = httpx.get(pdf["download_url"]).raise_for_status().content
            with open(out, "wb") as f:
                f.write(data)
            print(f"downloaded {out} ({len(data)} bytes)")
        finally:
            api.delete(f"/v1/sessions/{sid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
