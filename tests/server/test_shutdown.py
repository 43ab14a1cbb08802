"""SIGTERM: the server stops accepting, lets the running stream finish, then exits."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import openai
import pytest


def _lines(stream: object, out: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        out.put(line)


def _wait_for(lines: queue.Queue[str], pattern: str, timeout: float) -> re.Match[str]:
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


def test_sigterm_drains_the_running_stream_then_exits(tiny_folder: Path) -> None:
    cmd = [sys.executable, "-m", "specserve.server.cli_args", "--model", str(tiny_folder)]
    cmd += ["--alias", "tiny", "--dtype", "float64", "--device", "cpu", "--port", "0", "-np", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see conftest.one_torch_thread
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
    try:
        url = _wait_for(lines, r"Uvicorn running on (http://\S+)", timeout=60).group(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny", prompt="hello", max_tokens=400, temperature=0, stream=True
        )
        chunks = iter(stream)
        first = next(chunks)
        proc.send_signal(signal.SIGTERM)
        _wait_for(lines, "Shutting down", timeout=10)
        with pytest.raises(httpx2.TransportError):  # no longer accepting
            httpx2.get(url + "/health", timeout=5)
        rest = list(chunks)
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
        assert rest[-1].choices[0].finish_reason == "length"
        assert rest[-1].timings["predicted_n"] == 400 and len(text) > 0
        # uvicorn re-raises the signal after its graceful shutdown, as process managers expect
        assert proc.wait(timeout=30) == -signal.SIGTERM
        _wait_for(lines, "engine stopped", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
