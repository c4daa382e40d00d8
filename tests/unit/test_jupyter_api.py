"""The Jupyter API's pure parts: kernel ids of sessions, the legacy JSON protocol's checks, the
``token`` auth scheme."""

from __future__ import annotations

import json
import uuid

import pytest

from kernelmode.api.channels import legacy_message, legacy_text
from kernelmode.api.jupyter_api import kernel_id_of
from kernelmode.config import Settings
from kernelmode.errors import FrameError
from kernelmode.protocol.frames import Bounds, decode_frame, encode_frame
from kernelmode.tenants import Tenants


def test_kernel_ids_are_uuids_one_per_session() -> None:
    hex_id = uuid.uuid4().hex
    assert kernel_id_of(hex_id) == str(uuid.UUID(hex=hex_id))  # kernelmode's own ids: readable
    named = kernel_id_of("my-analysis")
    assert str(uuid.UUID(named)) == named and named == kernel_id_of("my-analysis")  # stable
    assert len({kernel_id_of(s) for s in ("a", "b", "my-analysis", "z" * 32, hex_id)}) == 5


def test_legacy_messages_are_checked_and_completed() -> None:
    bounds = Bounds(max_part_bytes=1 << 20)
    raw = json.dumps({"channel": "shell", "header": {"msg_id": "1", "msg_type": "execute_request"},
                      "content": {"code": "1"}})
    msg = legacy_message(decode_frame(raw, bounds))
    assert msg["msg_type"] == "execute_request" and msg["parent_header"] == {} and msg["metadata"] == {}
    # ...and re-encoded for the gateway as a v1 frame that decodes to the same message
    again = decode_frame(encode_frame(msg, "shell"), bounds)
    assert again["content"] == {"code": "1"} and again["channel"] == "shell"
    for bad in ('{"channel": "nowhere", "header": {}}', '{"channel": "shell", "header": []}',
                '{"channel": "shell", "header": {}, "metadata": 3}', '{"header": {}}'):
        with pytest.raises(FrameError):
            legacy_message(decode_frame(bad, bounds))


def test_legacy_text_of_a_kernel_message() -> None:
    msg = {"channel": "iopub", "header": {"msg_id": "m", "msg_type": "stream"}, "parent_header": {},
           "metadata": {}, "content": {"name": "stdout", "text": "hi"}}
    out = json.loads(legacy_text(msg))
    assert out["msg_type"] == "stream" and out["msg_id"] == "m" and out["channel"] == "iopub"
    assert out["content"]["text"] == "hi"


def test_token_scheme_beside_bearer() -> None:
    tenants = Tenants(Settings(), "secret-token")
    assert tenants.from_authorization("Bearer secret-token") is not None
    assert tenants.from_authorization("token secret-token") is not None
    assert tenants.from_authorization("Token secret-token") is not None
    assert tenants.from_authorization("Basic secret-token") is None
    assert tenants.from_authorization("token wrong") is None
