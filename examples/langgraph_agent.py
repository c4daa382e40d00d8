"""A LangGraph agent whose one tool is kernelmode's stateful Python, offline (no API key).

    KERNELMODE_URL=http://127.0.0.1:8888 KERNELMODE_TOKEN=... .venv/bin/python examples/langgraph_agent.py

Needs ``pip install 'kernelmode[langchain]'`` and a running ``kernelmode serve``. The agent is a
real LangGraph graph (``langchain.agents.create_agent``, the successor of LangGraph's
``create_react_agent``); only the chat model is a stand-in: a LangChain fake model that asks to
run code twice (load data into variables, then compute with them in a second call, which only
works because the session keeps its variables), then answers from what the kernel returned.
Swap in a real model (``ChatOpenAI(...)``, ``ChatAnthropic(...)``...) and nothing else changes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from langchain.agents import create_agent
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool

from kernelmode import Client
from kernelmode.adapters.langchain import as_langchain_tool

STEP_1 = """\
prices = {"apple": 3, "pear": 5, "plum": 2}
quantities = {"apple": 4, "pear": 6, "plum": 0}
print(f"loaded {len(prices)} products")"""

STEP_2 = "total = sum(prices[p] * quantities[p] for p in prices)\ntotal"


class ScriptedChatModel(FakeMessagesListChatModel):
    """A fake chat model: replays ``responses`` (tool calls), one per tool result received so
    far, then answers from the last tool result. ``bind_tools`` is a no-op: the script already
    knows the tool's name."""

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
                   **kwargs: Any) -> ScriptedChatModel:
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        done = sum(isinstance(m, ToolMessage) for m in messages)
        if done < len(self.responses):
            message = self.responses[done]
        else:
            last = str(messages[-1].content)
            value = re.search(r"\[result\]\n(.*)", last)
            message = AIMessage(content=f"The order total is {value.group(1)}." if value
                                else f"I could not compute the total; the kernel said:\n{last}")
        return ChatResult(generations=[ChatGeneration(message=message)])


def tool_call(code: str, n: int) -> AIMessage:
    return AIMessage(content="", tool_calls=[{"name": "run_python", "args": {"code": code},
                                              "id": f"call_{n}", "type": "tool_call"}])


def main() -> None:
    model = ScriptedChatModel(responses=[tool_call(STEP_1, 1), tool_call(STEP_2, 2)])
    with Client() as km:  # $KERNELMODE_URL and $KERNELMODE_TOKEN
        python = as_langchain_tool(km)
        try:
            agent = create_agent(model, [python], system_prompt="Use run_python for any computation.")
            state = agent.invoke({"messages": [HumanMessage("What is the total of my order?")]})
        finally:
            python.close()  # delete the session the tool created
    for m in state["messages"]:
        if isinstance(m, AIMessage) and m.tool_calls:
            print(f"--- model calls run_python:\n{m.tool_calls[0]['args']['code']}")
        elif isinstance(m, ToolMessage):
            print(f"--- kernel:\n{m.content}")
    print(f"--- final answer:\n{state['messages'][-1].content}")


if __name__ == "__main__":
    main()
