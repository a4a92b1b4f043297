"""kvgw's data plane: the HTTP/1.1 server every request arrives through, built on httptools' public
parser API and asyncio (uvloop), owned by kvgw rather than borrowed from another server's internals.

- ``server.py``: the listening socket, lifespan, graceful stop;
- ``protocol.py``: one connection: parsing, deadlines, caps, pipelining, flow control, ``sendfile``;
- ``lane.py``: index-only lookups answered inside the protocol (no ASGI cycle, no task);
- ``intake.py``: large PUT bodies received straight into the buffers the app keeps, or in a thread;
- ``cycle.py``: the ASGI cycle for everything else (the native and S3 APIs' other calls, the FastAPI
  control plane), with the ``http.response.zerocopysend`` extension for chunk bytes;
- ``limits.py``, ``heads.py``: connection limits and the answers given below the APIs; response heads.
"""
