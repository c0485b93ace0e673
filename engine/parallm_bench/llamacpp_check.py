"""Check the default model against an independent implementation: llama.cpp on the same GGUF file.

For 20 chat prompts (the demo's questions, rendered with the engine's chat template) it compares the
engine's next-token distribution with llama.cpp's (through llama-cpp-python): top-1 agreement, top-5
overlap, KL divergence, and the first answer token's probabilities. It also checks that the engine's
template renders what the GGUF's own template renders, and that llama.cpp's tokenizer gives the same ids.

llama-cpp-python is never a dependency of ParaLLM: it compiles llama.cpp from source (minutes). Run it
where it is installed, or point ``--llama-python`` (or ``PARALLM_LLAMA_CPP_PYTHON``) at an interpreter
that has it (a separate venv: ``python -m venv /tmp/lc && /tmp/lc/bin/pip install llama-cpp-python numpy``)::

    python -m parallm_bench.llamacpp_check --llama-python /tmp/lc/bin/python [--json out.json]

This file runs as a plain script in that interpreter too (``--worker``), so its top level imports only
the standard library and numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

N_PROMPTS = 20


# ----------------------------------------------------------------------------------------------
# The llama.cpp side (runs in whichever interpreter has llama_cpp)
# ----------------------------------------------------------------------------------------------


def llamacpp_logprobs(gguf: str, prompts: list[list[int]], texts: list[str]) -> dict:
    """llama.cpp's next-token log-probabilities after each prompt (token ids), and its tokenization of
    each text (special tokens parsed)."""
    from llama_cpp import Llama, llama_cpp

    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=os.cpu_count() or 2, logits_all=True, verbose=False)
    out = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        out.append(logits - np.logaddexp.reduce(logits))
    tokenized = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
    return {"logprobs": np.stack(out).astype(np.float32), "tokens": tokenized,
            "version": getattr(sys.modules.get("llama_cpp"), "__version__", "?"),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def _worker(inp: str, out: str) -> None:
    job = json.loads(Path(inp).read_text())
    res = llamacpp_logprobs(job["gguf"], job["prompts"], job["texts"])
    np.save(out + ".npy", res.pop("logprobs"))
    Path(out + ".json").write_text(json.dumps(res))


def run_llamacpp(gguf: str, prompts: list[list[int]], texts: list[str], python: str | None = None) -> dict:
    """llama.cpp's results, in this process if llama_cpp imports here, else by ``python`` (a path)."""
    if python is None:
        return llamacpp_logprobs(gguf, prompts, texts)
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "job.json", str(Path(tmp) / "result")
        inp.write_text(json.dumps({"gguf": gguf, "prompts": prompts, "texts": texts}))
        subprocess.run([python, str(Path(__file__).resolve()), "--worker", str(inp), out], check=True)
        res = json.loads(Path(out + ".json").read_text())
        res["logprobs"] = np.load(out + ".npy")
    return res


def llamacpp_python() -> str | None:
    """An interpreter with llama_cpp: this one (None), or $PARALLM_LLAMA_CPP_PYTHON. Raises if neither."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is not None:
        return None
    python = os.environ.get("PARALLM_LLAMA_CPP_PYTHON")
    if python and Path(python).exists():
        return python
    raise ModuleNotFoundError("llama_cpp is not importable here and PARALLM_LLAMA_CPP_PYTHON is not set")


# ----------------------------------------------------------------------------------------------
# The engine side and the comparison
# ----------------------------------------------------------------------------------------------


def engine_logprobs(eng, prompts: list[list[int]]) -> np.ndarray:
    """The engine's next-token log-probabilities after each prompt: its loaded model's forward pass
    (on the engine thread), full vocabulary."""
    import mlx.core as mx

    def forward(ids):
        def run():
            logits = eng.model(mx.array([ids]))[0, -1].astype(mx.float32)
            return np.array(logits - mx.logsumexp(logits))

        return eng.run_on_engine_thread(run, timeout=600)

    return np.stack([forward(ids) for ids in prompts])


def engine_top_logprobs(eng, prompt: list[int], k: int = 5) -> list[tuple[int, float]]:
    """The top-k of the engine's first sampled position, through a real request (scheduler, cache, kernels)."""
    r = eng.generate([prompt], max_tokens=1, temperature=0, logprobs=True, top_logprobs=k)[0]
    return [(tid, lp) for tid, _tok, lp in r.logprobs[0].top_logprobs]


def compare(p_ref: np.ndarray, p_eng: np.ndarray) -> dict:
    """Metrics for one prompt: ``p_ref`` (llama.cpp) and ``p_eng`` are log-probabilities over the vocabulary."""
    top_ref, top_eng = np.argsort(-p_ref)[:5], np.argsort(-p_eng)[:5]
    ref, eng = np.exp(p_ref.astype(np.float64)), np.exp(p_eng.astype(np.float64))
    return {
        "top1_agree": bool(top_ref[0] == top_eng[0]),
        "top5_overlap": len(set(top_ref.tolist()) & set(top_eng.tolist())) / 5,
        "kl_ref_eng": float(np.sum(ref * (p_ref.astype(np.float64) - p_eng))),  # KL(llama.cpp || engine), nats
        "max_abs_logprob_diff_top5": float(np.max(np.abs(p_ref[top_ref] - p_eng[top_ref]))),
        "entropy_ref": float(-np.sum(ref * p_ref)),
        "entropy_eng": float(-np.sum(eng * p_eng)),
        "top5_ref": top_ref.tolist(),
        "top5_eng": top_eng.tolist(),
    }


def gguf_template_render(gguf: str, messages: list[dict]) -> str:
    """The chat prompt as the GGUF's own template (``tokenizer.chat_template``) renders it."""
    import jinja2

    from parallm_engine.models.gguf import read_gguf_metadata

    template = read_gguf_metadata(gguf, want=lambda k: k == "tokenizer.chat_template")["tokenizer.chat_template"]
    return jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True)


def run_check(python: str | None = None, n_prompts: int = N_PROMPTS) -> dict:
    from parallm_engine import get_engine
    from parallm_bench.demo import DEMO_QUESTIONS
    from parallm_engine.models.loader import default_model_path

    gguf = str(default_model_path())
    eng = get_engine()
    questions = DEMO_QUESTIONS[:n_prompts]
    messages = [[{"role": "user", "content": q}] for q in questions]
    texts = [eng.apply_chat_template(m, tokenize=False) for m in messages]
    prompts = [eng.apply_chat_template(m) for m in messages]
    ref = run_llamacpp(gguf, prompts, texts, python)
    ours = engine_logprobs(eng, prompts)
    rows = [compare(r, o) for r, o in zip(ref["logprobs"], ours)]
    # The engine's own request path must agree with its forward pass (top-5 ids and log-probabilities).
    served = [engine_top_logprobs(eng, p) for p in prompts[:5]]
    served_ok = all(
        [t for t, _ in s] == row["top5_eng"] and max(abs(lp - float(o[t])) for t, lp in s) < 1e-3
        for s, row, o in zip(served, rows, ours)
    )
    vocab = eng.tokenizer
    france = questions.index("What is the capital of France?") if "What is the capital of France?" in questions else 0

    def first_tokens(lp):
        top = np.argsort(-lp)[:5]
        return [(vocab.decode([int(t)]), round(float(np.exp(lp[t])), 4)) for t in top]

    kls = [r["kl_ref_eng"] for r in rows]
    return {
        "prompts": len(rows),
        "llama_cpp": {"version": ref["version"], "system_info": ref["system_info"]},
        "top1_agreement": sum(r["top1_agree"] for r in rows) / len(rows),
        "top5_overlap_mean": float(np.mean([r["top5_overlap"] for r in rows])),
        "kl_mean": float(np.mean(kls)),
        "kl_max": float(np.max(kls)),
        "max_abs_logprob_diff_top5": float(max(r["max_abs_logprob_diff_top5"] for r in rows)),
        "entropy_ref_mean": float(np.mean([r["entropy_ref"] for r in rows])),
        "entropy_eng_mean": float(np.mean([r["entropy_eng"] for r in rows])),
        "template_matches_gguf": all(t == gguf_template_render(gguf, m) for t, m in zip(texts, messages)),
        "tokens_match_llama_cpp": all(list(a) == list(b) for a, b in zip(ref["tokens"], prompts)),
        "engine_requests_match_forward": served_ok,
        "france_first_token": {"llama_cpp": first_tokens(ref["logprobs"][france]),
                               "engine": first_tokens(ours[france])},
        "per_prompt": [{"question": q, **r} for q, r in zip(questions, rows)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-python", default=os.environ.get("PARALLM_LLAMA_CPP_PYTHON"),
                   help="an interpreter with llama_cpp (default: this one)")
    p.add_argument("--prompts", type=int, default=N_PROMPTS)
    p.add_argument("--json", default=None, help="also write the full result here")
    p.add_argument("--worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    res = run_check(args.llama_python, args.prompts)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    summary = {k: v for k, v in res.items() if k != "per_prompt"}
    print(json.dumps(summary, indent=2))
    for r in res["per_prompt"]:
        print(f"{r['question'][:44]:44s} top1 {'=' if r['top1_agree'] else 'x'} top5 {r['top5_overlap']:.1f} "
              f"KL {r['kl_ref_eng']:.5f} H {r['entropy_ref']:.2f}/{r['entropy_eng']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
