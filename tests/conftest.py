"""Shared fixtures: a real uvicorn server, configured as the services are, on a free port."""

import contextlib
import socket
import threading
import time

import pytest
import uvicorn

from blocktune.tuner.core.policy import ServerSettings
from blocktune.tuner.serving.http import server_config


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(app, settings: ServerSettings = ServerSettings()):  # noqa: B008 - frozen
    """Serve an ASGI app with uvicorn in a thread (the services' configuration with
    `settings`' connection limits); yields its base URL."""
    port = free_port()
    server = uvicorn.Server(server_config(app, host="127.0.0.1", port=port, server=settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def live_server():
    """`with live_server(app) as url:` runs the app on loopback for the test."""
    return serving
