"""The llama.cpp peer of `parallm bench`: llama.cpp's own server on the same GGUF, and `parallm serve`.

A Linux CPU user's alternative to ParaLLM is llama.cpp (what Ollama and LM Studio run on a CPU)
serving the same GGUF with parallel slots. The ``llamacpp`` workload starts llama.cpp's
``llama-server`` (``--parallel N --cont-batching``, threads on both cores) and ``parallm serve`` as
processes of their own, and drives both with the same async OpenAI-compatible client
(:func:`stream_completion`: ``POST /v1/completions`` with token-id prompts, streamed, over
loopback): throughput at 1 / 8 / 32 concurrent requests, TTFT and inter-token latency p50/p99.

Dtypes differ and are reported as they are: llama.cpp runs the GGUF's own quantization (Q4_1 with a
Q8_0 embedding for the default model; ``dtype`` in the JSON reads ``general.file_type``), ParaLLM its
dequantised fp32 weights on the CPU backend (``engine.model_info.dtype``).

Where ``llama-server`` comes from (:func:`find_llama_server`): ``$PARALLM_LLAMA_SERVER``, then
``llama-server`` on ``PATH``, then the copy :func:`build_llama_server` leaves in
``~/.cache/parallm/llama.cpp/``. Nothing here is part of the default install. To build it (a few
minutes of compiling on 2 cores, from PyPI's llama-cpp-python sdist, which carries llama.cpp's
source; the ``llamacpp`` extra brings CMake and Ninja where the system has none)::

    pip install -e "./engine[llamacpp]"          # optional: cmake + ninja from PyPI
    python -m parallm_bench.llamacpp build

llama-cpp-python's own server (``python -m llama_cpp.server``) is not used: it serves one request
at a time (a global lock around its one ``Llama``), so it has no parallel slots to compare with.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallm_bench.bench import _pct
from parallm_bench.server_process import ServerExited, free_port, wait_healthy
from parallm_engine.runner.weights_dtype import BF16_WEIGHTS

#: The llama-cpp-python sdist whose bundled llama.cpp :func:`build_llama_server` compiles.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CONCURRENCY = (1, 8, 32)
SERVED_NAME = "bench-model"  # both servers answer to this model name
SKIP_HINT = ("llama.cpp's llama-server was not found (set $PARALLM_LLAMA_SERVER, put llama-server on PATH, or "
             "build it: pip install -e './engine[llamacpp]' && python -m parallm_bench.llamacpp build)")

# llama.cpp's `general.file_type` (enum llama_ftype) for the formats a CPU user meets.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
               17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


# -- finding and building llama-server --------------------------------------------------------------

def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "parallm" / "llama.cpp" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"


def find_llama_server() -> str | None:
    """The llama-server binary to benchmark against, or None."""
    explicit = os.environ.get("PARALLM_LLAMA_SERVER")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    built = cache_dir() / "bin" / "llama-server"
    return str(built) if os.access(built, os.X_OK) else None


def sdist_download_command(dest: str) -> list[str]:
    """``pip download`` of llama-cpp-python's sdist only. ``--no-binary`` names the one package: with
    ``:all:`` it would apply to the sdist's build dependencies too (pip prepares the sdist's metadata in an
    isolated environment), and pip would compile CMake from source before llama.cpp."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", dest]


def build_llama_server(jobs: int | None = None, log=print) -> Path:
    """Compile llama-server from the llama-cpp-python sdist on PyPI (llama.cpp's source is vendored in it)
    into :func:`cache_dir`; returns the binary. Static, ``-march=native``, no web UI, no downloads."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("cmake is needed: apt-get install cmake, or pip install -e './engine[llamacpp]'")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise RuntimeError("a C++ compiler is needed (scripts/setup installs g++)")
    out = cache_dir() / "bin" / "llama-server"
    with tempfile.TemporaryDirectory(prefix="parallm-llama-") as tmp:
        log(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} (sdist) ...")
        subprocess.run(sdist_download_command(tmp), check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        shutil.unpack_archive(str(sdist), tmp)
        src = Path(tmp) / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
        build = Path(tmp) / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        log("configuring llama.cpp ...")
        subprocess.run([cmake, "-S", str(src), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                        "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON",
                        "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
                        "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"],
                       check=True, stdout=subprocess.DEVNULL)
        log("compiling llama-server (minutes) ...")
        subprocess.run([cmake, "--build", str(build), "--target", "llama-server",
                        "-j", str(jobs or os.cpu_count() or 2)], check=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", out)
    log(f"built {out}")
    return out


def gguf_dtype(gguf: str) -> str:
    """The GGUF's quantization as llama.cpp names it (``general.file_type``)."""
    from parallm_engine.models.gguf import read_gguf_metadata

    meta = read_gguf_metadata(gguf, want=lambda k: k == "general.file_type")
    ftype = meta.get("general.file_type")
    if hasattr(ftype, "item"):
        ftype = ftype.item()
    return _FILE_TYPES.get(int(ftype), f"file_type {ftype}") if ftype is not None else "unknown"


def engine_gguf(engine) -> str | None:
    """The GGUF file the engine's model was converted from (None for HF/MLX directories)."""
    return (engine.model_info.config.get("gguf_source") or {}).get("file")


# -- servers as processes of their own -------------------------------------------------------------

class ServerProcess:
    """A server subprocess on 127.0.0.1, ready once ``/health`` answers 200; stopped on exit."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: str, timeout: float = 180.0,
                 env: dict | None = None):
        self.name, self.argv, self.port, self.log_path, self.timeout = name, argv, port, log_path, timeout
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerProcess":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env)
        try:
            wait_healthy(self.url, self.proc, self.timeout, interval=0.2, name=self.name)
        except (ServerExited, TimeoutError) as exc:
            self.__exit__()
            raise RuntimeError(f"{exc}: {self.log_tail()}") from None
        return self

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def llama_threads() -> int:
    """llama-server's threads: ``$PARALLM_LLAMA_THREADS``, else one per core."""
    return int(os.environ.get("PARALLM_LLAMA_THREADS") or os.cpu_count() or 2)


def llama_env() -> dict:
    """llama-server's environment: this one, with OpenMP's idle threads sleeping instead of spinning
    (``OMP_WAIT_POLICY=passive``) unless the environment says otherwise. ggml's OpenMP barriers spin by
    default; on a machine where other processes want the cores, a spinning thread waits for one that
    was descheduled at every barrier (hundreds per token): on the shared 2-core machine llama-server
    took 1.5-3 s per token with two spinning threads and 20 ms with passive waiting or one thread.
    On an idle machine set OMP_WAIT_POLICY=active for llama.cpp's own default."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "passive")
    return env


def llama_server(binary: str, gguf: str, slots: int, ctx_per_slot: int, log_path: str) -> ServerProcess:
    """llama-server with ``slots`` parallel slots of ``ctx_per_slot`` tokens each, continuous batching,
    :func:`llama_threads` threads for decode and prompt processing; everything else at llama.cpp's
    defaults (its prompt cache on: ``cache_prompt`` and ``--cache-ram``)."""
    threads = str(llama_threads())
    port = free_port()
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(slots),
            "--cont-batching", "-c", str(slots * ctx_per_slot), "--threads", threads, "--threads-batch", threads,
            "--no-webui", "--alias", SERVED_NAME]
    return ServerProcess("llama-server", argv, port, log_path, env=llama_env())


def parallm_server(model: str, log_path: str, max_batch_size: int | None = None,
                   weights_dtype: str | None = None) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "parallm_engine.cli", "serve", "--model", model, "--port", str(port),
            "--log-level", "warning", "--served-model-name", SERVED_NAME]
    if max_batch_size:
        argv += ["--max-batch-size", str(max_batch_size)]
    env = dict(os.environ, PARALLM_WEIGHTS_DTYPE=weights_dtype) if weights_dtype else None
    return ServerProcess("parallm serve", argv, port, log_path, env=env)


# -- the client: the same for both servers ---------------------------------------------------------

async def stream_completion(client, url: str, body: dict, t0: float | None = None) -> dict:
    """One streamed OpenAI completion (``/v1/completions``) or llama.cpp-native ``/completion`` request.
    Returns the time to its first content chunk (from ``t0``, default: the request's start), every
    content chunk's arrival time, the tokens (usage, else chunks), cached prompt tokens and, where the
    server sends them (llama.cpp's ``return_tokens``), the generated token ids."""
    start = time.perf_counter() if t0 is None else t0
    times: list[float] = []
    usage: dict = {}
    ids: list[int] = []
    cached = None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter()
            if "choices" in chunk:  # OpenAI shape
                if any(c.get("text") for c in chunk["choices"]):
                    times.append(now)
                if chunk.get("usage"):
                    usage = chunk["usage"]
            else:  # llama.cpp's native /completion
                if chunk.get("tokens") or chunk.get("content"):
                    times.append(now)
                    ids.extend(chunk.get("tokens") or [])
                if chunk.get("stop"):
                    usage = {"completion_tokens": chunk.get("tokens_predicted"),
                             "prompt_tokens": chunk.get("tokens_evaluated")}
                    cached = (chunk.get("timings") or {}).get("cache_n")
    if cached is None:
        cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) if usage else None
    return {"ttft": times[0] - start if times else None, "times": times, "chunks": len(times),
            "tokens": usage.get("completion_tokens") or len(times), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": cached or 0, "ids": ids}


def latency_summary(tokens: int, wall: float, ttfts: list[float], itls: list[float], requests: int) -> dict:
    return {
        "requests": requests, "tokens": tokens, "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 2) if wall else 0.0,
        "ttft_p50_s": round(_pct(ttfts, 0.5), 4), "ttft_p99_s": round(_pct(ttfts, 0.99), 4),
        "itl_p50_s": round(_pct(itls, 0.5), 4), "itl_p99_s": round(_pct(itls, 0.99), 4),
    }


def run_load(base_url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """All prompts at once (concurrency = len(prompts)), greedy, EOS ignored, streamed."""
    import httpx

    async def main():
        limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(stream_completion(client, f"{base_url}/v1/completions", {
                "model": SERVED_NAME, "prompt": p, "max_tokens": new_tokens, "temperature": 0.0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}, t0) for p in prompts))
            return time.perf_counter() - t0, outs

    wall, outs = asyncio.run(main())
    ttfts = [o["ttft"] for o in outs if o["ttft"] is not None]
    itls = [b - a for o in outs for a, b in zip(o["times"], o["times"][1:])]
    out = latency_summary(sum(o["tokens"] for o in outs), wall, ttfts, itls, len(prompts))
    out["chunks"] = sum(o["chunks"] for o in outs)
    return out


# -- the workload ----------------------------------------------------------------------------------

def run_llamacpp_workload(engine, prompt_len: int, new_tokens: int, concurrency=CONCURRENCY, tick=None,
                          seed: int = 4321) -> dict:
    """Both servers up (each idle while the other is driven), the levels interleaved (ParaLLM, then
    llama.cpp, at each level) so drift in a shared machine's load hits both alike."""
    import random

    from parallm_bench.bench import _prompts

    tick = tick or (lambda msg: None)
    binary = find_llama_server()
    if binary is None:
        return {"skipped": SKIP_HINT}
    gguf = engine_gguf(engine)
    if gguf is None:
        return {"skipped": f"the model is not a GGUF file ({engine.model_info.source}); llama.cpp needs one"}
    rng = random.Random(seed)
    vocab = engine.model_info.vocab_size
    slots = max(concurrency)
    # --weights-dtype bfloat16[-matmul]: the server runs the same
    weights_dtype = engine.weights_dtype if engine.weights_dtype in BF16_WEIGHTS else None
    bf16 = weights_dtype is not None
    entry: dict = {
        "dtypes": {"llama_cpp": f"{gguf_dtype(gguf)} (the GGUF's own quantization)",
                   "parallm": (f"{engine.backend.dtype} (dequantised on load)" if bf16 else
                               f"{engine.model_info.dtype} (dequantised on load)")},
        "llama_server": {"binary": binary, "slots": slots, "threads": llama_threads(),
                         "omp_wait_policy": llama_env()["OMP_WAIT_POLICY"]},
        "gguf": gguf, "prompt_len": prompt_len, "new_tokens": new_tokens, "levels": {},
    }
    with tempfile.TemporaryDirectory(prefix="parallm-bench-") as logs, \
            llama_server(binary, gguf, slots, prompt_len + new_tokens + 16, f"{logs}/llama.log") as lc, \
            parallm_server(gguf, f"{logs}/parallm.log", max_batch_size=engine.config.max_batch_size,
                           weights_dtype=weights_dtype) as pm:
        warm = _prompts(rng, 2, 8, vocab)
        run_load(lc.url, warm, 4)  # first requests: allocations, thread start-up
        run_load(pm.url, warm, 4)
        for c in concurrency:
            prompts = _prompts(rng, c, prompt_len, vocab)  # fresh ids: no prefix-cache hits on either server
            level = {}
            tick(f"llamacpp: parallm serve at {c}")
            level["parallm"] = run_load(pm.url, prompts, new_tokens)
            tick(f"llamacpp: llama-server at {c}")
            level["llama_cpp"] = run_load(lc.url, prompts, new_tokens)
            level["ratios"] = level_ratios(level["parallm"], level["llama_cpp"])
            entry["levels"][str(c)] = level
    top = entry["levels"][str(max(concurrency))]["ratios"]
    entry["ratios"] = {f"tok_s_vs_llama_cpp_at_{c}": entry["levels"][str(c)]["ratios"]["tok_s"] for c in concurrency}
    entry["ratios"][f"ttft_p99_vs_llama_cpp_at_{max(concurrency)}"] = top["ttft_p99"]
    return entry


def level_ratios(p: dict, ref: dict) -> dict:
    """ParaLLM vs llama.cpp: tok/s ratio (> 1: ParaLLM faster), latency ratios reference / ParaLLM (> 1:
    ParaLLM lower)."""
    def r(a, b):
        return round(a / b, 2) if b else None

    return {"tok_s": r(p["tok_s"], ref["tok_s"]), "ttft_p50": r(ref["ttft_p50_s"], p["ttft_p50_s"]),
            "ttft_p99": r(ref["ttft_p99_s"], p["ttft_p99_s"]), "itl_p50": r(ref["itl_p50_s"], p["itl_p50_s"]),
            "itl_p99": r(ref["itl_p99_s"], p["itl_p99_s"])}


def format_lines(entry: dict) -> list[str]:
    if "skipped" in entry:
        return []
    lines = [f"llamacpp: same GGUF, same client over loopback; dtypes: ParaLLM {entry['dtypes']['parallm']}, "
             f"llama.cpp {entry['dtypes']['llama_cpp']}; llama-server --parallel {entry['llama_server']['slots']} "
             f"--cont-batching, {entry['llama_server']['threads']} threads"]
    for c, level in entry["levels"].items():
        for system in ("parallm", "llama_cpp"):
            s = level[system]
            lines.append(f"  {c:>3} concurrent {system:9s}: {s['tok_s']:7.1f} tok/s  TTFT p50 {s['ttft_p50_s']:.3f} "
                         f"p99 {s['ttft_p99_s']:.3f} s  ITL p50 {s['itl_p50_s'] * 1e3:.1f} "
                         f"p99 {s['itl_p99_s'] * 1e3:.1f} ms")
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="llama.cpp peer for `parallm bench --workloads llamacpp`")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help=f"compile llama-server from llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}'s sdist")
    b.add_argument("-j", "--jobs", type=int, default=None)
    sub.add_parser("where", help="print the llama-server that `parallm bench` would use")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build_llama_server(args.jobs)
        return 0
    found = find_llama_server()
    print(found or SKIP_HINT)
    return 0 if found else 1


if __name__ == "__main__":
    raise SystemExit(main())
