"""Live servers for the server tests: uvicorn in a thread, tiny float64 qwen2, char tokenizer."""

from __future__ import annotations

import json
import queue
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
import torch
import uvicorn

from specserve.engine.engine import Engine
from specserve.engine.request import SpecParams
from specserve.engine.runner import ModelRunner
from specserve.loading.model import LoadedModel, load_model
from specserve.server.app import ServerConfig, build_app
from specserve.server.loop import EngineLoop
from specserve.server.transport import TransportLimits, uvicorn_config
from specserve.speculative.registry import build_speculator
from tests.tiny import write_hf_folder, write_tokenizer

MODEL_ID = "tiny"
CTX = 512  # the tiny model's whole context: long generations for the disconnect tests
# a role-tagged template in printable ASCII (the char tokenizer's vocabulary): the chat prompt
# is plain text, so the same text sent to /v1/completions gives the same prompt ids
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def chat_text(messages: list[dict[str, str]]) -> str:
    """What CHAT_TEMPLATE renders (for /v1/completions with the same prompt)."""
    return "".join(f"<{m['role']}>{m['content']}|" for m in messages) + "<assistant>"


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen2-chat")
    write_hf_folder("qwen2", folder, seed=1)
    write_tokenizer(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


@pytest.fixture(scope="session")
def tiny_model(tiny_folder: Path) -> LoadedModel:
    return load_model(tiny_folder, "float64")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # on a small shared machine two OpenMP threads spin against each other and against the
    # server's own threads: one thread is ~20x faster for a model this small
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class LiveServer:
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    loop: EngineLoop

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        assert not self.thread.is_alive(), "the server did not shut down"


def start_server(
    loaded: LoadedModel,
    *,
    parallel: int = 4,
    max_queue: int = 8,
    api_key: str | None = None,
    spec_types: tuple[str, ...] = (),
    limits: TransportLimits | None = None,
    webui: bool = True,
) -> LiveServer:
    """A server on a free 127.0.0.1 port; the model's weights are shared between servers.

    `limits` sets the transport limits (server/transport.py); by default, serve's defaults."""
    assert loaded.tokenizer is not None
    runner = ModelRunner(loaded.model, num_slots=parallel, max_len=CTX)
    loop = EngineLoop(Engine(runner, build_speculator(spec_types)), max_queue)
    spec = SpecParams(n_max=16 if spec_types else 0)
    config = ServerConfig(MODEL_ID, api_key=api_key, spec_types=spec_types, spec_defaults=spec)
    config.transport = limits or config.transport
    config.webui = webui
    app = build_app(loop, loaded.tokenizer, config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; no race with other tests
    server = uvicorn.Server(
        uvicorn_config(app, config.transport, log_level="warning", timeout_graceful_shutdown=5)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    host, port = sock.getsockname()
    return LiveServer(f"http://{host}:{port}", server, thread, loop)


@pytest.fixture(scope="module")
def live(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    """The main server: 4 parallel slots, room for 8 waiting requests, no API key."""
    server = start_server(tiny_model)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def drafting(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    """Two slots drafting with n-grams of the context and the request's prediction."""
    server = start_server(
        tiny_model, parallel=2, spec_types=("ngram-map-k", "suffix", "prediction")
    )
    yield server
    server.stop()


def pump_lines(stream: IO[str], out: queue.Queue[str]) -> None:
    """A thread's body: every line of a subprocess's output into `out`."""
    for line in stream:
        out.put(line)


def wait_for_line(lines: queue.Queue[str], pattern: str, timeout: float) -> re.Match[str]:
    """The first line of `lines` that matches `pattern`, waiting at most `timeout` s."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        seen.append(line)
        if m := re.search(pattern, line):
            return m
    raise AssertionError(f"no {pattern!r} in server output:\n{''.join(seen)}")
