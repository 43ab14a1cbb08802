"""A `specserve serve` subprocess for the serving benchmarks: start, wait, measure, stop.
(`InProcessServer` is the same server in a thread, for tests.)

    with ServerProcess(ServerSpec(model="qwen2.5-coder-0.5b", slots=4), log_path) as server:
        ...  # clients talk to server.url; server.rss_mib() reads its resident memory

The server runs in its own process so that the clients' Python (SSE parsing, timing) does
not share a GIL with the engine thread, and so that its resident memory is its own.
It binds 127.0.0.1 port 0 (the kernel picks a free port, no race with other processes)
and we read the port from uvicorn's "Uvicorn running on ..." line in its log.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx2

from specserve.errors import SpecserveError

MODEL_ID = "bench"  # the --alias every benchmark server gets, so clients need not know paths
_URL_LINE = re.compile(r"(?:Uvicorn|Ray Serve) running on (http://[^\s:]+:\d+)")


@dataclass(frozen=True)
class ServerSpec:
    """The `specserve serve` flags a benchmark varies; everything else is the default."""

    model: str = "qwen2.5-coder-0.5b"
    dtype: str = "float32"
    weights: str = "auto"  # --weights, as `specserve serve` defaults: auto, dequant, int8, ...
    slots: int = 4
    spec_type: str = "ngram-map-k,suffix"  # "none" turns speculation off
    device: str | None = None  # None: the server's own choice (cuda when available)
    ctx_size: int = 0
    threads: int = 0  # OMP_NUM_THREADS for the server; 0 = torch's default
    cache_ram: float | None = None  # --cache-ram MiB (the prompt store); None: the default
    replicas: int = 0  # > 0: `serve --replicas N` on Ray Serve, `threads` each (min 1)
    router: str = "affinity"  # the cluster's --router
    share_outputs: bool = False  # the cluster's --share-outputs

    def flags(self) -> list[str]:
        """The `specserve serve` flags for this server on a free 127.0.0.1 port."""
        flags = ["--model", self.model, "--alias", MODEL_ID, "--dtype", self.dtype]
        flags += ["--weights", self.weights]
        flags += ["-np", str(self.slots), "--spec-type", self.spec_type]
        flags += ["--host", "127.0.0.1", "--port", "0", "--ctx-size", str(self.ctx_size)]
        flags += ["--cache-ram", f"{self.cache_ram:g}"] if self.cache_ram is not None else []
        if self.replicas:
            flags += ["--replicas", str(self.replicas), "--router", self.router]
            flags += ["--threads", str(self.threads or 1)]
            flags += ["--share-outputs"] if self.share_outputs else []
        return flags + (["--device", self.device] if self.device else [])

    def argv(self) -> list[str]:
        if self.replicas:  # the cluster is `specserve serve`'s, not the one-server module's
            return [sys.executable, "-m", "specserve.cli", "serve", *self.flags()]
        return [sys.executable, "-m", "specserve.server.cli_args", *self.flags()]


def read_rss_mib(pid: int | str, field: str = "VmRSS") -> float:
    """Resident memory of a process (a pid or "self") in MiB, from /proc/PID/status: VmRSS
    (now) or VmHWM (its peak since it started or since `reset_peak_rss`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024  # the kernel reports kB
    raise SpecserveError(f"no {field} for process {pid}")


def reset_peak_rss() -> bool:
    """Start this process's VmHWM afresh from its current RSS (Linux: clear_refs 5), so one
    benchmark row's peak does not include an earlier row's; False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class _Started:
    """A context manager over start() / stop(): stopped on the way out, and when the start
    itself fails half-way (a subprocess or thread may already run)."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> object:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class Subprocess(_Started):
    """A server in a subprocess, its output in `log_path`; stopped on the way out."""

    def __init__(self, log_path: Path, startup_timeout: float) -> None:
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "the server is not started"
        return self._proc.pid

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server drains and exits), then SIGKILL if it takes over `timeout`."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class ServerProcess(Subprocess):
    """One benchmark server in a subprocess; a context manager that always stops it."""

    def __init__(self, spec: ServerSpec, log_path: Path, startup_timeout: float = 900.0):
        super().__init__(log_path, startup_timeout)
        self.spec = spec

    def start(self) -> None:
        """Start the server and return once /health answers ok."""
        env = dict(os.environ)
        if self.spec.threads:
            env["OMP_NUM_THREADS"] = str(self.spec.threads)
        with self.log_path.open("wb") as log:  # the child keeps its own copy of the fd
            self._proc = subprocess.Popen(
                self.spec.argv(), stdout=log, stderr=subprocess.STDOUT, env=env
            )
        self.url = self._wait_for_url()
        self._wait_for_health()

    def rss_mib(self) -> float:
        return read_rss_mib(self.pid)

    def _wait_for_url(self) -> str:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if m := _URL_LINE.search(self.log_path.read_text(errors="replace")):
                return m.group(1)
            if self._proc.poll() is not None:
                raise SpecserveError(f"the server exited at start:\n{self.log_tail()}")
            time.sleep(0.1)
        self.stop()
        raise SpecserveError(f"the server did not start in {self.startup_timeout:.0f}s")

    def _wait_for_health(self) -> None:
        # the URL line comes after the lifespan started the engine, so this is one try
        # in the normal case; a few more cover a slow first accept on a busy machine
        for _ in range(50):
            try:
                if httpx2.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            time.sleep(0.1)
        raise SpecserveError(f"{self.url}/health did not answer ok:\n{self.log_tail()}")


class InProcessServer(_Started):
    """The same server in a thread of this process: starts in a moment (no second torch
    import), for tests and quick checks. Its clients share the GIL with the engine thread
    and its RSS is this whole process's, so measured runs use `ServerProcess`.
    """

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.url = ""
        self.pid = os.getpid()
        self._server: Any = None  # a uvicorn.Server once started
        self._thread: threading.Thread | None = None
        self._torch_threads = 0

    def start(self) -> None:
        import socket

        import torch
        import uvicorn

        from specserve.server.app import build_app
        from specserve.server.cli_args import add_serve_args, build_server

        parser = argparse.ArgumentParser()
        add_serve_args(parser)
        # the subprocess's own flags, so both kinds of server are configured identically
        args = parser.parse_args(self.spec.flags())
        args.device = args.device or "cpu"
        # OMP_NUM_THREADS is read once at torch's start: set it here, before the engine
        # thread's first torch call picks it up
        if self.spec.threads:
            self._torch_threads = torch.get_num_threads()
            torch.set_num_threads(self.spec.threads)
        loop, cfg, loaded = build_server(args)
        assert loaded.tokenizer is not None
        app = build_app(loop, loaded.tokenizer, cfg)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # the kernel picks a free port
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise SpecserveError("the in-process server did not start")
            time.sleep(0.02)
        host, port = sock.getsockname()
        self.url = f"http://{host}:{port}"

    def rss_mib(self) -> float:
        return read_rss_mib(self.pid)

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(60)
            self._server = None
        if self._torch_threads:
            import torch

            torch.set_num_threads(self._torch_threads)
            self._torch_threads = 0


def launch(spec: ServerSpec, log_path: Path, in_process: bool) -> ServerProcess | InProcessServer:
    """The server a benchmark configuration runs against (a context manager)."""
    return InProcessServer(spec) if in_process else ServerProcess(spec, log_path)


class RssSampler:
    """Samples a process's RSS at start, every `interval` seconds, and at stop (a thread).

    `progress()` is read with each sample (e.g. requests finished so far), so the table can
    show memory against work done, not only against time.
    """

    def __init__(self, pid: int, interval: float, progress: Callable[[], int]) -> None:
        self.pid = pid
        self.interval = interval
        self.progress = progress
        self.samples: list[tuple[float, float, int]] = []  # (seconds, RSS MiB, progress)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._sample()
        self._thread.start()

    def stop(self) -> list[tuple[float, float, int]]:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.samples

    def _run(self) -> None:
        # aim at t0 + k * interval, so slow samples do not push later ones off the grid
        k = 1
        while not self._stop.wait(max(0.0, self._t0 + k * self.interval - time.monotonic())):
            self._sample()
            k += 1

    def _sample(self) -> None:
        t = time.monotonic() - self._t0
        self.samples.append((t, read_rss_mib(self.pid), self.progress()))


def server_spec(args: argparse.Namespace, slots: int, spec: str) -> ServerSpec:
    """The server `bench serve` starts for `slots` slots and speculation `spec` (on/off)."""
    return ServerSpec(
        model=str(args.model),
        dtype=args.dtype,
        weights=args.weights,
        slots=slots,
        spec_type=args.spec_type if spec == "on" else "none",
        device=args.device,
        ctx_size=args.ctx_size,
        threads=args.threads,
    )
