"""SIGTERM: the server stops accepting, lets the running stream finish, then exits."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx2
import openai
import pytest

from tests.server.conftest import pump_lines, wait_for_line


def test_sigterm_drains_the_running_stream_then_exits(tiny_folder: Path) -> None:
    cmd = [sys.executable, "-m", "specserve.server.cli_args", "--model", str(tiny_folder)]
    cmd += ["--alias", "tiny", "--dtype", "float64", "--device", "cpu", "--port", "0", "-np", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see conftest.one_torch_thread
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=pump_lines, args=(proc.stderr, lines), daemon=True).start()
    try:
        url = wait_for_line(lines, r"Uvicorn running on (http://\S+)", timeout=60).group(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny", prompt="hello", max_tokens=400, temperature=0, stream=True
        )
        chunks = iter(stream)
        first = next(chunks)
        proc.send_signal(signal.SIGTERM)
        wait_for_line(lines, "Shutting down", timeout=10)
        with pytest.raises(httpx2.TransportError):  # no longer accepting
            httpx2.get(url + "/health", timeout=5)
        rest = list(chunks)
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
        assert rest[-1].choices[0].finish_reason == "length"
        assert rest[-1].timings["predicted_n"] == 400 and len(text) > 0
        # uvicorn re-raises the signal after its graceful shutdown, as process managers expect
        assert proc.wait(timeout=30) == -signal.SIGTERM
        wait_for_line(lines, "engine stopped", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
