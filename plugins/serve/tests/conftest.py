"""Servers for the tests, on 127.0.0.1: the default model with policies none and copy
(one for every test), and the same model with a tool-capable chat template (one per
module that asks for it)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import openai
import pytest
import uvicorn
from specdec.loading import default_model_path
from specdec_serve import Engine, make_app

#: ChatML with Qwen2.5's <tool_call> frame, written for the tool tests
TOOL_TEMPLATE = Path(__file__).parent / "data" / "tool_template.jinja"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(engine: Engine) -> tuple[uvicorn.Server, threading.Thread, str]:
    """``engine`` served on a free port in a thread: the server, its thread, its URL."""
    port = _free_port()
    config = uvicorn.Config(make_app(engine), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    return srv, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def server():
    """``(base_url, engine)``: the default model served with policies none and copy."""
    engine = Engine(None, ["none", "copy"])
    srv, thread, base = _serve(engine)
    yield base, engine
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """``(base_url, engine, openai client)``: the default model with a chat template that
    has a tool-call format (:data:`TOOL_TEMPLATE`), served with none and copy as model
    ``tools``."""
    src = Path(default_model_path())
    folder = tmp_path_factory.mktemp("tool-model")
    for f in src.iterdir():
        if f.name == "tokenizer_config.json":
            cfg = json.loads(f.read_text())
            cfg["chat_template"] = TOOL_TEMPLATE.read_text()
            (folder / f.name).write_text(json.dumps(cfg))
        else:
            os.symlink(f, folder / f.name)
    engine = Engine(str(folder), ["none", "copy"], model_name="tools")
    srv, thread, base = _serve(engine)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    yield base, engine, client
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()
