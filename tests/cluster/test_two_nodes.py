"""Two Ray nodes on one machine, made as a user makes a cluster: `ray start --head` and
`ray start --address` (separate raylets, 1 CPU each), then `specserve serve --replicas 2
--ray-address` in its own process. Each replica needs the whole CPU of a node, so two
running replicas are one on each node. Driven through the ingress only.

Slow. Its teardown runs `ray stop`, which stops every Ray node of this user on the
machine, so it must not share a run with another live Ray instance (pytest runs the
modules one after another, and the other module's cluster is down by then)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest

from specserve.server.transport import free_port
from tests.cluster.test_ray_serve import REPLICA, chat
from tests.server.conftest import LiveServer, start_server

pytest.importorskip("ray", reason="the cluster extra (make setup-cluster)")
pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _ray(*argv: str, env: dict[str, str]) -> str:
    # a home of its own: `ray start` sends ~/.ray/auth_token when one exists (another Ray
    # run may have left it), and a head started without token auth then refuses the node
    home = {"HOME": str(Path(env["RAY_TMPDIR"]) / "home")}
    out = subprocess.run(
        [str(BIN / "ray"), *argv], env=env | home, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    # Ray's socket paths must stay short: a temp dir of its own under /tmp
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path_factory.mktemp("ray", numbered=True))}
    # an earlier ray.init in this process (another module's cluster) set token auth in
    # os.environ; this cluster is made without it, as `ray start` makes one by default
    env.pop("RAY_AUTH_MODE", None)
    address = f"127.0.0.1:{free_port()}"
    head = ["start", "--head", "--port", address.split(":")[1], "--num-cpus", "1"]
    _ray(*head, "--include-dashboard", "false", "--disable-usage-stats", env=env)
    try:
        _ray("start", "--address", address, "--num-cpus", "1", "--disable-usage-stats", env=env)
        yield address, env
    finally:
        _ray("stop", "--force", env=env)


@pytest.fixture(scope="module")
def ingress(
    nodes: tuple[str, dict[str, str]], tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    from specserve.ops.cpu import build

    build.problem()  # the kernels built here, not by two replicas racing for the build lock
    address, env = nodes
    argv = [str(BIN / "specserve"), "serve", "--model", str(tiny_folder), "--alias", "tiny"]
    argv += ["--dtype", "float64", "-np", "2", "--ctx-size", "512", "--threads", "1"]
    argv += ["--replicas", "2", "--ray-address", address, "--port", str(free_port())]
    argv += ["--affinity-threshold", "1"]  # a busy replica passes turns on at once
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r"running on (http://\S+):", log.read_text(errors="replace"))):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield m.group(1)
    finally:
        proc.terminate()
        proc.wait(120)


@pytest.fixture(scope="module")
def single(tiny_model) -> Iterator[LiveServer]:  # noqa: ANN001
    server = start_server(tiny_model, parallel=2, spec_types=("ngram-map-k", "suffix"))
    yield server
    server.stop()


def test_one_replica_on_each_node_through_the_ingress(
    nodes: tuple[str, dict[str, str]], ingress: str, single: LiveServer
) -> None:
    address, env = nodes
    status = _ray("status", "--address", address, env=env)
    assert len(re.findall(r"^\s*1 node_", status, re.M)) == 2, status
    assert re.search(r"2\.0/2\.0 CPU", status), status  # a replica holds each node's CPU
    # a replica counts as live once it has posted to the board: the second may post a
    # beat after the ingress says it is running
    deadline = time.monotonic() + 60
    while (health := httpx2.get(f"{ingress}/health", timeout=30)).json()["replicas"] < 2:
        assert time.monotonic() < deadline, health.json()
        time.sleep(0.5)
    assert health.status_code == 200 and health.json()["replicas"] == 2
    asks = [[{"role": "user", "content": f"question {i} about the two nodes"}] for i in range(6)]
    with ThreadPoolExecutor(len(asks)) as pool:  # at once: the queues send some to each node
        got = list(pool.map(lambda m: chat(ingress, m, max_tokens=48), asks))
    for messages, r in zip(asks, got, strict=True):
        want = chat(single.url, messages, max_tokens=48).json()["choices"]
        assert r.json()["choices"] == want
    assert len({r.headers[REPLICA] for r in got}) == 2  # both nodes' replicas answered
