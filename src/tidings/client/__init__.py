"""Client of the broker's Journal service (asyncio, with a thin sync facade later).

This first cut covers what the CLI, tests and benchmarks need: append (streamed chunks, with
register and offset expectations), read (blocking, tailing), list, apply, fragments. Non-OK
statuses raise the StatusError subclass of `tidings.protocol.status`; transient ones
(no primary yet, route changing) are retried with backoff.
"""

from tidings.client._async import AppendResult, AsyncClient, ReadChunk

__all__ = ["AppendResult", "AsyncClient", "ReadChunk"]
