"""`parallm bench --workloads spec`: n-gram (prompt lookup) speculative decoding on copy-heavy prompts.

Agents copy: JSON echoed with one field changed, a tool result quoted back in a summary. Each prompt here
is one of those two tasks over its own ~300-token block (chat template of the loaded model). The same
prompts run greedy with and without ``speculative={"method": "ngram", ...}`` at three concurrencies
(single stream, 8, 32), alternating the two systems, with the prompts already in the prefix cache (the
agent case; the timed runs then measure decoding, not prefill); reported per concurrency: tok/s of each
(generated tokens / wall, the better of the runs), the ratio, whether every request produced the same tokens, and
the acceptance rate (accepted / proposed drafted tokens).

The draft-model method (``draft`` entry): the loaded model as the target and, as its draft, a copy of it
cut to its first ``DRAFT_LAYERS`` layers (same embeddings, final norm and head: no training), built in
memory through the engine's loader; the same prompts, plain vs ``{"method": "draft", ...}``, at
``draft_concurrency`` (the speculator speculates only where measured step costs say it pays: ``spec_policy``). An
untrained cut of a 135M model is a weak draft: the line reports what it gains or costs as measured.
"""

from __future__ import annotations

import json
import random
import time

SPEC = {"method": "ngram", "num_tokens": 4}
FULL_SPEC = {"concurrency": (1, 8, 32), "new_tokens": 160, "runs": 2, "draft_concurrency": (1, 4)}
QUICK_SPEC = {"concurrency": (1, 8), "new_tokens": 48, "runs": 1, "draft_concurrency": (1,)}
#: Layers of the target the draft model keeps (SmolLM2-135M has 30).
DRAFT_LAYERS = 8
DRAFT_TOKENS = 3


def _json_block(rng: random.Random) -> dict:
    services = ["auth", "billing", "search", "cache", "gateway", "mailer", "reports", "scheduler"]
    return {
        "project": f"atlas-{rng.randrange(100, 999)}",
        "version": f"{rng.randrange(1, 5)}.{rng.randrange(0, 20)}.{rng.randrange(0, 9)}",
        "owner": {"team": rng.choice(["platform", "data", "infra"]), "email": "ops@example.com"},
        "services": [
            {"name": s, "port": rng.randrange(3000, 9000), "replicas": rng.randrange(1, 6),
             "env": {"LOG_LEVEL": rng.choice(["info", "debug", "warn"]), "TIMEOUT_MS": rng.randrange(100, 5000)}}
            for s in rng.sample(services, 5)
        ],
        "features": {"beta_search": rng.random() < 0.5, "dark_mode": True, "rate_limit": rng.randrange(10, 500)},
    }


def _tool_result(rng: random.Random) -> str:
    rows = []
    for i in range(14):
        rows.append(f"{2024 + i % 2}-0{1 + i % 9}-{10 + i:02d} order #{rng.randrange(10000, 99999)} "
                    f"status={rng.choice(['shipped', 'pending', 'refunded'])} total=${rng.randrange(5, 900)}.{rng.randrange(10, 99)}")
    return "\n".join(rows)


def copy_prompts(engine, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` copy-heavy chat prompts: half edit a JSON block, half summarise a tool result quoting it."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            block = json.dumps(_json_block(rng), indent=1)
            msg = ("Here is a configuration file:\n" + block +
                   "\n\nReturn the complete file unchanged except that \"dark_mode\" becomes false.")
        else:
            msg = ("The order lookup tool returned:\n" + _tool_result(rng) +
                   "\n\nSummarise the result for the customer, quoting every order line exactly.")
        prompts.append(engine.apply_chat_template([{"role": "user", "content": msg}]))
    return prompts


def _run(engine, prompts: list[list[int]], new_tokens: int, speculative) -> dict:
    stats0 = engine.stats()
    t0 = time.perf_counter()
    results = engine.generate(prompts, max_tokens=new_tokens, temperature=0, speculative=speculative)
    wall = time.perf_counter() - t0
    stats1 = engine.stats()
    tokens = sum(len(r.token_ids) for r in results)
    proposed = stats1["spec_proposed_tokens"] - stats0["spec_proposed_tokens"]
    accepted = stats1["spec_accepted_tokens"] - stats0["spec_accepted_tokens"]
    return {"tok_s": tokens / wall if wall else 0.0, "wall_s": wall, "tokens": tokens,
            "ids": [r.token_ids for r in results], "proposed": proposed, "accepted": accepted}


def run_spec(engine, sizes: dict | None = None, tick=lambda msg: None) -> dict:
    sizes = sizes or FULL_SPEC
    out: dict = {"speculative": SPEC, "new_tokens": sizes["new_tokens"]}
    engine.generate(copy_prompts(engine, 1, seed=99), max_tokens=8, temperature=0, speculative=SPEC)  # warm up
    for conc in sizes["concurrency"]:
        tick(f"spec: {conc} concurrent, ngram vs plain")
        prompts = copy_prompts(engine, conc, seed=conc)
        out[f"batch_{conc}"] = _plain_vs(engine, prompts, sizes, SPEC, "ngram")
    if sizes.get("draft_concurrency"):
        out["draft"] = run_draft(engine, sizes, tick)
    return out


def _plain_vs(engine, prompts, sizes: dict, spec: dict, name: str) -> dict:
    """Plain decoding vs ``spec`` on ``prompts``, ``sizes["runs"]`` runs each, alternating (drift on a busy
    machine hits both). The prompts are prefilled once first (the agent case: a conversation's context is
    in the prefix cache), so tok/s measures decoding, which is what speculation changes."""
    engine.generate(prompts, max_tokens=1, temperature=0)
    plain, runs = [], []
    for _ in range(sizes["runs"]):
        plain.append(_run(engine, prompts, sizes["new_tokens"], False))
        runs.append(_run(engine, prompts, sizes["new_tokens"], spec))
    best_plain = max(plain, key=lambda r: r["tok_s"])
    best_spec = max(runs, key=lambda r: r["tok_s"])
    proposed = sum(r["proposed"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    return {
        "plain_tok_s": round(best_plain["tok_s"], 2),
        f"{name}_tok_s": round(best_spec["tok_s"], 2),
        "speedup": round(best_spec["tok_s"] / best_plain["tok_s"], 3) if best_plain["tok_s"] else 0.0,
        "runs_plain_tok_s": [round(r["tok_s"], 2) for r in plain],
        f"runs_{name}_tok_s": [round(r["tok_s"], 2) for r in runs],
        "same_tokens": all(r["ids"] == plain[0]["ids"] for r in plain + runs),
        "tokens": best_spec["tokens"],
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
    }


def truncated_draft(engine, layers: int = DRAFT_LAYERS):
    """A copy of the engine's model (loaded again by the engine's loader) keeping its first ``layers``
    layers, for the draft-model method."""
    from parallm_engine.models.loader import load_model

    net, _, _ = load_model(engine.model_info.source)
    inner = getattr(net, "model", net)
    layers = min(layers, len(inner.layers))
    inner.layers = inner.layers[:layers]
    if hasattr(net.args, "num_hidden_layers"):
        net.args.num_hidden_layers = layers
    return net


def run_draft(engine, sizes: dict, tick=lambda msg: None, layers: int = DRAFT_LAYERS) -> dict:
    """Plain vs a draft model cut from the target, greedy, on the copy-heavy prompts."""
    draft = truncated_draft(engine, layers)
    spec = {"method": "draft", "model": draft, "num_tokens": DRAFT_TOKENS}
    out: dict = {"layers": len(draft.layers), "target_layers": len(engine.model.layers),
                 "num_tokens": DRAFT_TOKENS}
    engine.generate(copy_prompts(engine, 1, seed=99), max_tokens=8, temperature=0, speculative=spec)  # warm up
    for conc in sizes["draft_concurrency"]:
        tick(f"spec: {conc} concurrent, draft model ({out['layers']} layers) vs plain")
        prompts = copy_prompts(engine, conc, seed=conc)
        out[f"batch_{conc}"] = _plain_vs(engine, prompts, sizes, spec, "draft")
    return out


def format_lines(entry: dict) -> list[str]:
    lines = [f"spec (ngram {entry['speculative']['num_tokens']} tokens, {entry['new_tokens']} new tokens, greedy):"]
    for key, row in entry.items():
        if key.startswith("batch_"):
            lines.append(f"  {key[6:]:>3} concurrent: plain {row['plain_tok_s']:8.1f} tok/s  ngram "
                         f"{row['ngram_tok_s']:8.1f} tok/s  x{row['speedup']:.2f}  acceptance "
                         f"{row['acceptance_rate']:.2f}  same tokens: {row['same_tokens']}")
    draft = entry.get("draft")
    if draft:
        lines.append(f"  draft model (first {draft['layers']} of {draft['target_layers']} layers, "
                     f"{draft['num_tokens']} tokens):")
        for key, row in draft.items():
            if key.startswith("batch_"):
                lines.append(f"  {key[6:]:>3} concurrent: plain {row['plain_tok_s']:8.1f} tok/s  draft "
                             f"{row['draft_tok_s']:8.1f} tok/s  x{row['speedup']:.2f}  acceptance "
                             f"{row['acceptance_rate']:.2f}  same tokens: {row['same_tokens']}")
    return lines
