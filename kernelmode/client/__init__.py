"""Python client for the kernelmode REST API: ``Client`` (sync) and ``AsyncClient``, on httpx.

::

    from kernelmode import Client

    with Client("http://127.0.0.1:8888", token="...") as km:
        with km.create_session() as s:           # deleted when the block ends
            s.upload("sales.csv", b"region,amount\\nnorth,10\\n")
            s.run("import pandas as pd; df = pd.read_csv('/mnt/data/sales.csv')")
            print(s.run("df.amount.sum()").result)
        print(km.run_once("print(6 * 7)").stdout)  # one-shot: a fresh kernel, discarded after

Results are the server's own pydantic models (RunResult, SessionInfo...). A failure is an
exception from kernelmode.errors carrying the server's error code (``SessionNotFound``,
``TooManySessions``...); a failure in the user's code is not an exception but a RunResult with
``status == "error"``. Requests are retried only where that is safe: a request that never
reached the server (connection refused), and reads (GET) on 502/503/504.

The rooms: ``_routes`` is the route table and the request of every method (no I/O);
``_base`` what both flavours share that does no I/O (settings, retry policy, error mapping);
``_sync`` and ``_async`` only send. The two flavours have the same methods with the same
parameters and reach the same routes (tests/unit/test_client_parity.py).
"""

from ..errors import ServerUnreachable
from ._async import AsyncClient, AsyncSession
from ._base import DEFAULT_URL, error_from_response
from ._sync import Client, Session

__all__ = ["DEFAULT_URL", "AsyncClient", "AsyncSession", "Client", "ServerUnreachable", "Session",
           "error_from_response"]
