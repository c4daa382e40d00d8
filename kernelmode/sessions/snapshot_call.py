"""The snapshot request: kernel/snapshot.py run (silently) in a kernel, and its one answer, checked.

The kernel is untrusted: its code can answer the request itself (a module of its own under the
snapshot's name, a display message of the snapshot's MIME type). So an answer is input, parsed
by the strict models below before anything is stored or shown; a malformed one is
CheckpointAnswerRefused (502 ``checkpoint_answer_refused``), never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ..errors import CheckpointAnswerRefused, CheckpointFailed, KernelmodeError, KernelUnavailable
from ..gateway.exchange import ExecuteExchange
from ..gateway.execution import OutputCollector
from ..protocol import SNAPSHOT_MIME as MIME
from .boot import snapshot_code
from .kernels import Kernel

_MAX_NAMES = 100_000  # variables in one answer (the collector's 4 MB bounds it too)
_Name = Annotated[str, StringConstraints(min_length=1, max_length=1000)]
_Text = Annotated[str, StringConstraints(max_length=2000)]


class _Answer(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)
    error: _Text | None = None


class NamedReason(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: _Name
    reason: _Text


class SaveAnswer(_Answer):
    """``{"unchanged": true}``, ``{"error"}`` or what was saved and skipped."""

    unchanged: bool = False
    saved: list[_Name] = Field(default_factory=list, max_length=_MAX_NAMES)
    skipped: list[NamedReason] = Field(default_factory=list, max_length=_MAX_NAMES)
    seconds: float = Field(0.0, ge=0, allow_inf_nan=False)


class LoadAnswer(_Answer):
    """``{"error"}`` or what came back and what was lost."""

    restored: list[_Name] = Field(default_factory=list, max_length=_MAX_NAMES)
    lost: list[NamedReason] = Field(default_factory=list, max_length=_MAX_NAMES)


A = TypeVar("A", bound=_Answer)


def parse_answer(model: type[A], raw: dict[str, Any] | None) -> A:
    """The kernel's answer as ``model``; CheckpointAnswerRefused naming the first bad field."""
    if raw is None:
        return model(error="no answer")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors(include_input=False, include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "the answer"
        raise CheckpointAnswerRefused(
            f"the kernel's answer to the checkpoint request is malformed ({where}: {first['msg']}; "
            f"{e.error_count()} error(s)); nothing was saved. Kernel code may have replaced the snapshot "
            "module: run `import sys; sys.modules.pop('kernelmode_snapshot', None)` (or restart the "
            "kernel: POST /v1/sessions/{id}/restart) and try again") from None


async def call_snapshot(k: Kernel, request: dict[str, Any], timeout: float, grace: float) -> dict[str, Any] | None:
    """Run the snapshot module in the kernel (silently) and read its answer (None: it gave none,
    a dict with ``error`` when the code raised); unchecked: see ``parse_answer``."""
    if k.conn is None or not k.conn.is_open:
        raise KernelUnavailable(f"session {k.info.session_id!r}: the kernel is not connected")
    collector = OutputCollector(1024 * 1024, max_display_bytes=4 * 1024 * 1024)
    exchange = ExecuteExchange(collector, on_input=lambda msg: k.answer_input("checkpoint", msg, []))
    await exchange.send(k.conn, snapshot_code(request), silent=True)
    loop = asyncio.get_running_loop()
    try:
        outcome = await exchange.collect(loop.time() + timeout)
        if outcome == "timeout":
            with contextlib.suppress(KernelmodeError):
                await k.interrupt()
                await exchange.collect(loop.time() + grace)
            raise CheckpointFailed(f"took longer than {timeout:g} s and was interrupted")
        if outcome != "done":
            k.died_under_run()
            raise KernelUnavailable(f"the kernel died during the {request['op']} ({outcome})")
    finally:
        exchange.close()
    for output in collector.outputs:
        answer = output.get("data", {}).get(MIME)
        if isinstance(answer, dict):
            return answer
    if collector.error:
        return {"error": f"{collector.error.ename}: {collector.error.evalue}"[:2000]}
    return None
