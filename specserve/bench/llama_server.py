"""The peer as a server: llama.cpp's `llama-server` on the same GGUF, for benchmarks that
drive a server through its OpenAI routes (`bench serve --sessions ... --llama-server BIN`).

Built by ../shared/tools/build-llama-cpp (see DEVELOPERS.md); never downloaded here.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2

from specserve.bench.server_process import Subprocess, read_rss_mib
from specserve.errors import SpecserveError
from specserve.server.transport import free_port


@dataclass(frozen=True)
class LlamaServerSpec:
    """What a llama-server run varies; `cache_ram_mib` 0 turns its RAM prompt cache off."""

    exe: Path
    gguf: Path
    slots: int
    ctx_per_slot: int
    cache_ram_mib: float
    threads: int = 0  # 0: llama.cpp's default
    spec: bool = True  # --spec-default (ngram-mod), llama.cpp's own default speculation

    def argv(self, port: int) -> list[str]:
        argv = [str(self.exe), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["-np", str(self.slots), "-c", str(self.slots * self.ctx_per_slot)]
        argv += ["--cache-ram", str(int(self.cache_ram_mib)), "--no-webui"]
        if self.threads:
            argv += ["-t", str(self.threads), "-tb", str(self.threads)]
        return argv + (["--spec-default"] if self.spec else [])


class LlamaServer(Subprocess):
    """One llama-server in a subprocess; a context manager that always stops it."""

    def __init__(self, spec: LlamaServerSpec, log_path: Path, startup_timeout: float = 300.0):
        if not spec.exe.is_file() or not os.access(spec.exe, os.X_OK):
            raise SpecserveError(
                f"no llama-server at {spec.exe}: build it with ../shared/tools/build-llama-cpp"
            )
        super().__init__(log_path, startup_timeout)
        self.spec = spec

    def start(self) -> None:
        """Start llama-server and return once /health answers ok."""
        port = free_port()
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self.spec.argv(port), stdout=log, stderr=subprocess.STDOUT
            )
        self.url = f"http://127.0.0.1:{port}"
        self._wait_for_health()

    def peak_rss_mib(self) -> float:
        return read_rss_mib(self.pid, "VmHWM")

    def _wait_for_health(self) -> None:
        # /health is 503 while the model loads, 200 once it serves
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SpecserveError(f"llama-server exited at start:\n{self.log_tail()}")
            try:
                if httpx2.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            time.sleep(0.2)
        raise SpecserveError(f"llama-server did not start in {self.startup_timeout:.0f}s")
