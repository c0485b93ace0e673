"""Decode throughput of a batch with grammar constraints vs without, in one run on one engine.

``python -m parallm_bench.constrained [--n 32] [--new-tokens 128] [--model NAME]`` or, from
``parallm bench``, :func:`run_constrained_bench` (returns a dict) / :func:`format_line`.

Workloads, all ``n`` requests submitted at once with the same chat prompts, greedy, ``new_tokens`` each:

- ``unconstrained``: no grammar (EOS ignored so every row decodes ``new_tokens`` tokens).
- ``constrained``:   every row under a JSON schema (an array of objects with ``minItems`` high enough
                     that no row can finish early, so the batch stays full).
- ``mixed``:         half the rows constrained, half not.

Decode throughput is the tokens delivered after every request has its first token, divided by the time
from that moment to the last token (prefill excluded). ``ratio`` = constrained / unconstrained.
"""

from __future__ import annotations

import argparse
import asyncio
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
                },
                "required": ["name", "qty", "tags"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "inventory", "schema": SCHEMA}}
TOPICS = ["a bakery", "a hardware store", "a library", "a garden shop", "a toy store", "a pharmacy",
          "a bike shop", "a music store"]


def _prompts(engine, n: int) -> list[list[int]]:
    return [
        engine.apply_chat_template(
            [{"role": "user", "content": f"List the inventory of {TOPICS[i % len(TOPICS)]} (#{i}) as JSON."}]
        )
        for i in range(n)
    ]


def _run(engine, prompts, new_tokens: int, constrained: list[bool]) -> dict:
    async def main():
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        handles = [
            engine.submit(p, loop=loop, max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                          response_format=RESPONSE_FORMAT if c else None)
            for p, c in zip(prompts, constrained)
        ]

        async def consume(h):
            times = []
            async for d in h:
                if d.token_ids:
                    times.extend([time.perf_counter()] * len(d.token_ids))
            return times

        outs = await asyncio.gather(*(consume(h) for h in handles))
        return t0, outs, [h.request.result for h in handles]

    t0, outs, results = asyncio.run(main())
    start = max(o[0] for o in outs if o)
    end = max(o[-1] for o in outs if o)
    decoded = sum(1 for o in outs for t in o if t > start)
    stopped = sum(r.finish_reason == "stop" for r in results)
    return {
        "requests": len(prompts),
        "constrained": sum(constrained),
        "tokens": sum(len(o) for o in outs),
        "wall_s": round(end - t0, 3),
        "decode_s": round(end - start, 3),
        "decode_tok_s": round(decoded / (end - start), 1) if end > start else 0.0,
        "finished_early": stopped,
    }


#: ``parallm bench --workloads constrained`` sizes: (requests, new tokens per request)
FULL_CONSTRAINED = (32, 128)
QUICK_CONSTRAINED = (8, 32)


def run_constrained_bench(engine, n: int = 32, new_tokens: int = 128, repeats: int = 1) -> dict:
    """Best of ``repeats`` for each workload (interleaved, so drift in machine load hits all alike)."""
    prompts = _prompts(engine, n)
    engine.generate(prompts[:2], max_tokens=4, temperature=0, response_format=RESPONSE_FORMAT)  # warm-up
    layouts = {
        "unconstrained": [False] * n,
        "constrained": [True] * n,
        "mixed": [i % 2 == 0 for i in range(n)],
    }
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for name, layout in layouts.items():
            r = _run(engine, prompts, new_tokens, layout)
            if name not in best or r["decode_tok_s"] > best[name]["decode_tok_s"]:
                best[name] = r
    base = best["unconstrained"]["decode_tok_s"] or 1.0
    return {
        **best,
        "ratio": round(best["constrained"]["decode_tok_s"] / base, 3),
        "ratio_mixed": round(best["mixed"]["decode_tok_s"] / base, 3),
        "n": n,
        "new_tokens": new_tokens,
    }


def format_line(r: dict) -> str:
    u, c, m = r["unconstrained"], r["constrained"], r["mixed"]
    return (
        f"constrained decode, batch {r['n']} x {r['new_tokens']} tokens: unconstrained {u['decode_tok_s']} tok/s, "
        f"constrained {c['decode_tok_s']} tok/s (ratio {r['ratio']:.2f}), "
        f"half constrained {m['decode_tok_s']} tok/s (ratio {r['ratio_mixed']:.2f})"
    )


def format_lines(entry: dict) -> list[str]:
    """``parallm bench``'s lines for the workload (``bench.format_table``)."""
    return [format_line(entry)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    from parallm_engine.core.registry import get_engine

    engine = get_engine(args.model)
    r = run_constrained_bench(engine, args.n, args.new_tokens, args.repeats)
    for name in ("unconstrained", "constrained", "mixed"):
        print(name, r[name])
    print(format_line(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
