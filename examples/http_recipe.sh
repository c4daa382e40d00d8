#!/usr/bin/env bash
# The automation recipe of docs/automation.md as plain HTTP calls (what an n8n "HTTP Request"
# node, a CI job or any tool without a client library sends). Needs curl and python3 (for JSON).
#   KERNELMODE_URL=http://127.0.0.1:8888 KERNELMODE_TOKEN=... bash examples/http_recipe.sh
set -euo pipefail
URL=${KERNELMODE_URL:-http://127.0.0.1:8888}
AUTH="Authorization: Bearer ${KERNELMODE_TOKEN:?set KERNELMODE_TOKEN}"
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1], {}, {'d': d}))" "$1"; }

# 1. Create a session.
SID=$(curl -sf -X POST "$URL/v1/sessions" -H "$AUTH" -H 'Content-Type: application/json' \
      -d '{"ttl_seconds": 600}' | json 'd["session_id"]')
trap 'curl -sf -X DELETE "$URL/v1/sessions/$SID" -H "$AUTH" >/dev/null || true' EXIT
echo "session: $SID"

# 2. Upload the input (raw body; the path is where the code finds it under /mnt/data).
printf 'region,amount\nnorth,120\nsouth,80\neast,45\n' |
  curl -sf -X PUT "$URL/v1/sessions/$SID/files/sales.csv" -H "$AUTH" --data-binary @- >/dev/null

# 3. Execute: read it, write a report and a chart.
CODE='import pandas as pd, matplotlib
matplotlib.use("Agg")
df = pd.read_csv("/mnt/data/sales.csv")
df.sort_values("amount").to_csv("/mnt/data/report.csv", index=False)
df.plot.bar(x="region", y="amount").figure.savefig("/mnt/data/chart.png")
int(df.amount.sum())'
RESULT=$(python3 -c 'import json,sys; print(json.dumps({"code": sys.argv[1], "timeout_seconds": 120}))' "$CODE" |
         curl -sf -X POST "$URL/v1/sessions/$SID/execute" -H "$AUTH" -H 'Content-Type: application/json' -d @-)
echo "status: $(echo "$RESULT" | json 'd["status"]')  total: $(echo "$RESULT" | json 'd["result"]')"

# 4. Download the artifacts: signed links, no token needed (hand them to the next step).
REPORT_URL=$(echo "$RESULT" | json '[a["download_url"] for a in d["artifacts"] if a["name"] == "report.csv"][0]')
CHART_URL=$(echo "$RESULT" | json '[a["download_url"] for a in d["artifacts"] if a["name"] == "chart.png"][0]')
OUT=${OUT_DIR:-.}
curl -sf "$REPORT_URL" -o "$OUT/report.csv"
curl -sf "$CHART_URL" -o "$OUT/chart.png"
echo "downloaded: $OUT/report.csv $OUT/chart.png"
