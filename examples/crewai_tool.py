"""kernelmode's stateful Python as a CrewAI tool.

    KERNELMODE_URL=http://127.0.0.1:8888 KERNELMODE_TOKEN=... .venv/bin/python examples/crewai_tool.py

Needs ``pip install 'kernelmode[crewai]'`` and a running ``kernelmode serve``. This calls the
tool directly, twice, as a CrewAI agent would: the second call uses variables the first one set,
which works because the tool keeps one session. It does not run a Crew: a Crew needs a real LLM
(an API key and the network); with one, give the tool to an agent and that is all::

    analyst = Agent(role="Data analyst", goal="Answer with numbers computed in Python",
                    backstory="...", tools=[python])
    Crew(agents=[analyst], tasks=[Task(description="...", expected_output="...",
                                       agent=analyst)]).kickoff()

Host tools registered on the server (kernelmode.yaml ``tools:``, or ``ToolRegistry`` in library
mode) are callable from the code as ``tools.NAME(...)``: the agent needs no other tool for them.
"""

from __future__ import annotations

import os

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")  # offline: no telemetry attempts
os.environ.setdefault("OTEL_SDK_DISABLED", "true")

from crewai.tools import BaseTool  # noqa: E402  (after the telemetry switches)

from kernelmode import Client  # noqa: E402
from kernelmode.adapters.crewai import as_crewai_tool  # noqa: E402


def main() -> None:
    with Client() as km:  # $KERNELMODE_URL and $KERNELMODE_TOKEN
        python = as_crewai_tool(km)
        assert isinstance(python, BaseTool)
        try:
            print(python.run(code='orders = [("apple", 3, 4), ("pear", 5, 6), ("plum", 2, 0)]\n'
                                  'print(f"{len(orders)} order lines loaded")'))
            print(python.run(code="total = sum(price * qty for _, price, qty in orders)\n"
                                  'f"order total: {total}"'))
        finally:
            python.close()  # delete the session the tool created


if __name__ == "__main__":
    main()
