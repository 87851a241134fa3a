"""One server for every test: the default model with policies none and copy, on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time

import openai
import pytest
import uvicorn
from specdec_serve import Engine, make_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server():
    """``(base_url, engine)``: the default model served with policies none and copy."""
    engine = Engine(None, ["none", "copy"])
    port = _free_port()
    config = uvicorn.Config(make_app(engine), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)
