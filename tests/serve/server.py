"""An `hkv serve` app running in this process for a test: uvicorn in a daemon thread on a free port of
127.0.0.1, stopped (drained) when the `with` block ends."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

try:  # the HTTP client the openai package depends on (httpx, or its successor httpx2)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

__all__ = ["httpx", "running"]


@contextlib.contextmanager
def running(app, *, start_timeout: float = 120.0, stop_timeout: float = 60.0):
    """Serve `app` on 127.0.0.1 (a port the OS picks); yields the base URL ("http://127.0.0.1:PORT").

    The socket is bound before the server starts, so no other process can take the port in between;
    at the end the server is asked to exit (`should_exit`: no new connections, running requests
    finish, the app's lifespan shuts down) and the thread is joined within `stop_timeout`.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=stop_timeout / 2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the test server did not start within {start_timeout} s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(stop_timeout)
        sock.close()
        assert not thread.is_alive(), f"the test server did not stop within {stop_timeout} s"
