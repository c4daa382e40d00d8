"""Writes the example notebooks of this folder (run it after editing the cells below).

The notebooks are generated with nbformat so that their JSON is always valid; the test suite
executes them top to bottom (nbclient) against a real `kernelmode serve`.
"""

from pathlib import Path

import nbformat
from nbformat import v4

HERE = Path(__file__).parent
KERNEL = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
          "language_info": {"name": "python"}}

CONNECT = '''import os

from kernelmode import Client

# `kernelmode serve` prints its URL and token; export them before starting Jupyter:
#   export KERNELMODE_URL=http://127.0.0.1:8888 KERNELMODE_TOKEN=...
km = Client(os.environ.get("KERNELMODE_URL", "http://127.0.0.1:8888"), os.environ["KERNELMODE_TOKEN"])
km.health()'''


def quickstart() -> nbformat.NotebookNode:
    md, code = v4.new_markdown_cell, v4.new_code_cell
    return v4.new_notebook(metadata=KERNEL, cells=[
        md("# kernelmode quickstart\n\nA stateful, sandboxed Python session driven from here: first "
           "with plain HTTP (what any tool can send), then with the Python client. Start a server "
           "first (`make run`, or `kernelmode serve`) and set `KERNELMODE_URL` and `KERNELMODE_TOKEN`."),
        md("## 1. Plain HTTP"),
        code('''import os

import httpx

url = os.environ.get("KERNELMODE_URL", "http://127.0.0.1:8888")
http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {os.environ['KERNELMODE_TOKEN']}"},
                    timeout=120)
session = http.post("/v1/sessions", json={}).json()
sid = session["session_id"]
sid'''),
        code('''r = http.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 21\\nprint('hello from the sandbox')"})
r.json()["status"], r.json()["stdout"]'''),
        md("Variables persist between calls of the same session:"),
        code('''http.post(f"/v1/sessions/{sid}/execute", json={"code": "x * 2"}).json()["result"]'''),
        code('''http.delete(f"/v1/sessions/{sid}").status_code'''),
        md("## 2. The Python client\n\nThe same through `kernelmode.Client`: typed results, sessions "
           "that close themselves, files in and out."),
        code(CONNECT),
        code('''csv = b"region,amount\\nnorth,120\\nsouth,80\\neast,45\\n"

with km.create_session() as s:
    s.upload("sales.csv", csv)
    s.run("import pandas as pd\\ndf = pd.read_csv('/mnt/data/sales.csv')")
    total = s.run("int(df.amount.sum())").result
    chart = s.run("ax = df.plot.bar(x='region', y='amount')\\n"
                  "ax.figure.savefig('/mnt/data/chart.png')")
total, [a.name for a in chart.artifacts]'''),
        md("Files the code writes come back as artifacts with download links that need no token:"),
        code('''png = km.download_artifact(chart.artifacts[0])
png[:4]'''),
        md("No session needed? A one-shot run uses a fresh kernel that is thrown away afterwards:"),
        code('''km.run_once("import sys; sys.version.split()[0]").result'''),
        md("A failing cell is a result, not an exception; the session stays usable:"),
        code('''with km.create_session() as s:
    bad = s.run("1/0")
    print(bad.status, bad.error.ename)
    print(s.run("'still alive'").result)'''),
    ])


def debugging() -> nbformat.NotebookNode:
    md, code = v4.new_markdown_cell, v4.new_code_cell
    return v4.new_notebook(metadata=KERNEL, cells=[
        md("# Debugging what an agent did\n\nAn agent ran an analysis in a session and something went "
           "wrong. Here we replay such a session, read what happened, step into the same live kernel, "
           "and export the whole story as a notebook."),
        code(CONNECT),
        md("## The agent's session\n\n(In real life the agent did this through MCP or REST.)"),
        code('''agent = km.create_session()
agent.upload("orders.csv", b"id,amount\\n1,10\\n2,oops\\n3,30\\n")
agent.run("import pandas as pd\\norders = pd.read_csv('/mnt/data/orders.csv')")
failed = agent.run("orders.amount.astype(float).sum()")
failed.status, failed.error.ename, failed.error.evalue'''),
        md("## What did it do?\n\n`kernelmode sessions` lists the sessions; the notebook export shows "
           "every run with its outputs, in order:"),
        code('''import subprocess
import sys

print(subprocess.run([sys.executable, "-m", "kernelmode.cli", "sessions"], capture_output=True, text=True).stdout)'''),
        code('''import nbformat

nb = nbformat.reads(km.notebook(agent.id), as_version=4)
for cell in nb.cells[1:]:
    print(">>>", cell.source)
    for out in cell.outputs:
        print("   ", out.output_type, out.get("ename", ""), out.get("evalue", ""))'''),
        md("## Step into the live kernel\n\nIn a terminal, `kernelmode console SESSION_ID` opens a "
           "real `jupyter console` on this very kernel: `orders` is there, and whatever you fix is "
           "seen by the agent's next call. Here we do the same through the client:"),
        code('''print(f"kernelmode console {agent.id}")
agent.run("orders['amount'] = pd.to_numeric(orders.amount, errors='coerce')")
agent.run("orders.amount.sum()").result'''),
        md("Other frontends attach through a connection file: "
           "`kernelmode console SESSION_ID --connection-file` prints one for "
           "`jupyter qtconsole --existing FILE` (or an editor's \"existing kernel\")."),
        md("## Close it\n\nClosing keeps the session's notebook with its artifacts:"),
        code('''agent.close()
[a.name for a in km.artifacts(agent.id)]'''),
    ])


if __name__ == "__main__":
    for name, nb in (("quickstart", quickstart()), ("debugging", debugging())):
        nbformat.validate(nb)
        nbformat.write(nb, HERE / f"{name}.ipynb")
        print("wrote", HERE / f"{name}.ipynb")
