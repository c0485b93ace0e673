"""`parallm demo`: fan many chat prompts out at once on one engine, then run some of the same prompts one
at a time, and say plainly what the two rows compare."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a short poem about the sea.",
    "Explain in one sentence what a language model is.",
    "What are the primary colors?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Name three planets in our solar system.",
    "How do plants make their food?",
    "What is the boiling point of water?",
    "Suggest a name for a friendly robot.",
    "What does a librarian do?",
    "Give a tip for learning a new language.",
    "What is the largest ocean on Earth?",
    "Write a haiku about autumn leaves.",
    "Why do we need sleep?",
    "What is photosynthesis?",
    "List three fruits that are red.",
    "How many days are there in a leap year?",
    "What is the opposite of hot?",
    "Describe the taste of a lemon.",
    "What is a volcano?",
    "Give one reason to exercise.",
    "What language is spoken in Brazil?",
    "What is the tallest animal?",
    "How do bees help flowers?",
    "Tell me a fun fact about octopuses.",
    "What is gravity?",
    "Write a sentence using the word 'bright'.",
    "What is the freezing point of water in Fahrenheit?",
    "Why do leaves change colour in autumn?",
    "What is the main ingredient of bread?",
]


@dataclass
class RunStats:
    """One way of running prompts: how many, the tokens they generated, wall time, TTFTs."""

    mode: str
    prompts: int
    tokens: int
    wall_s: float
    ttfts: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ttft_p50(self) -> float:
        ordered = sorted(self.ttfts)
        return ordered[len(ordered) // 2] if ordered else 0.0


@dataclass
class DemoResult:
    parallel: RunStats
    sequential: RunStats | None
    answers: list[tuple[str, str]]
    peak_in_flight: int
    cache_hit_rate: float
    bar_done: int  # tokens the progress bar counted
    bar_total: int  # its total when it closed (= tokens generated: requests that stop early shrink it)


def run_parallel(eng, prompts: list, sampling: dict, max_tokens: int, bar_file=None) -> tuple[RunStats, list, int, int]:
    """Every prompt in flight at once; a live bar counts generated tokens. The bar starts at prompts x
    max_tokens and its total drops as each answer ends early, so it closes at 100% of what was generated."""
    from tqdm import tqdm

    handles = [eng.submit(p, **sampling) for p in prompts]
    t0 = time.monotonic()
    lock = threading.Lock()
    with tqdm(total=len(prompts) * max_tokens, unit="tok", desc=f"{len(prompts)} prompts in parallel",
              file=bar_file if bar_file is not None else sys.stderr) as bar:

        def drain(handle) -> None:
            counted = 0
            for delta in handle:
                with lock:
                    bar.update(len(delta.token_ids))
                counted += len(delta.token_ids)
            generated = handle.request.result.usage.completion_tokens
            with lock:
                bar.update(generated - counted)
                bar.total -= max_tokens - generated  # it stopped early: the rest will never come
                bar.refresh()

        threads = [threading.Thread(target=drain, args=(h,)) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bar_done, bar_total = bar.n, bar.total
    wall = time.monotonic() - t0
    results = [h.request.result for h in handles]
    stats = RunStats("parallel", len(prompts), sum(r.usage.completion_tokens for r in results), wall,
                     [r.metrics["ttft"] for r in results])
    return stats, results, bar_done, bar_total


def run_sequential(eng, prompts: list, sampling: dict, bar_file=None) -> RunStats:
    """The same prompts, each alone: the next starts when the previous has finished."""
    from tqdm import tqdm

    t0 = time.monotonic()
    tokens, ttfts = 0, []
    for p in tqdm(prompts, desc="the same prompts, one at a time", unit="req",
                  file=bar_file if bar_file is not None else sys.stderr):
        r = eng.generate([p], **sampling)[0]
        tokens += r.usage.completion_tokens
        ttfts.append(r.metrics["ttft"])
    return RunStats("one at a time", len(prompts), tokens, time.monotonic() - t0, ttfts)


def run_demo(eng, n: int = 32, max_tokens: int = 48, sequential: int = 4, bar_file=None) -> DemoResult:
    questions = (DEMO_QUESTIONS * (n // len(DEMO_QUESTIONS) + 1))[:n]
    prompts = [eng.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    # Greedy: the model's most likely answer, the same in both rows (the same prompt gives the same tokens).
    sampling = {"max_tokens": max_tokens, "temperature": 0.0}
    eng.generate([prompts[0]], max_tokens=2, temperature=0.0)  # warm-up
    eng.reset_peaks()
    parallel, results, bar_done, bar_total = run_parallel(eng, prompts, sampling, max_tokens, bar_file)
    stats = eng.stats()
    seq = run_sequential(eng, prompts[: min(sequential, n)], sampling, bar_file) if sequential > 0 else None
    return DemoResult(parallel, seq, [(q, r.text.strip()) for q, r in zip(questions, results)],
                      int(stats["peak_in_flight"]), float(stats["cache_hit_rate"]), int(bar_done), int(bar_total))


def results_table(result: DemoResult, max_tokens: int):
    """The closing table: fits 80 columns (long notes go below it, as text that wraps)."""
    from rich.table import Table

    table = Table(title=f"Greedy, up to {max_tokens} new tokens per prompt")
    for col in ("mode", "prompts", "new tokens", "wall s", "tok/s", "TTFT p50 s"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for run in (result.parallel, result.sequential):
        if run is not None:
            table.add_row(run.mode, str(run.prompts), str(run.tokens), f"{run.wall_s:.1f}", f"{run.tok_s:.1f}",
                          f"{run.ttft_p50:.2f}")
    return table


def comparison(result: DemoResult) -> str:
    """What the two rows compare, in words, with the speedup."""
    par, seq = result.parallel, result.sequential
    lines = [f"Peak batch {result.peak_in_flight} requests; prefix cache hit rate {result.cache_hit_rate:.0%}."]
    if seq is None or not seq.tokens or not seq.tok_s:
        return lines[0]
    if seq.prompts == par.prompts:
        lines.insert(0, f"Both rows ran the same {par.prompts} prompts: {par.wall_s:.1f} s in parallel, "
                        f"{seq.wall_s:.1f} s one at a time, [bold]{seq.wall_s / par.wall_s:.1f}x faster[/].")
    else:
        estimate = par.tokens / seq.tok_s
        lines.insert(0, f"One at a time ran the first {seq.prompts} of the same {par.prompts} prompts "
                        f"(--sequential {par.prompts} runs them all): at {seq.tok_s:.1f} tok/s all {par.prompts} "
                        f"would take about {estimate:.0f} s; in parallel they took {par.wall_s:.1f} s, "
                        f"[bold]{par.tok_s / seq.tok_s:.1f}x faster[/] (tokens per second).")
    return "\n".join(lines)


def main(args) -> int:
    from rich.console import Console

    from parallm_engine.runner.backend import backend_info
    from parallm_engine.core.registry import get_engine

    console = Console()
    t_load = time.monotonic()
    eng = get_engine(args.model, **args.engine_config)
    console.print(f"[bold]ParaLLM demo[/] model={eng.model_name} {backend_info().summary()} "
                  f"(loaded in {time.monotonic() - t_load:.1f}s)")
    result = run_demo(eng, n=args.n, max_tokens=args.max_tokens, sequential=args.sequential)
    for q, a in result.answers[: args.show]:
        console.print(f"[cyan]Q:[/] {q}\n[green]A:[/] {a[:200]}")
    console.print(results_table(result, args.max_tokens))
    console.print(comparison(result))
    return 0
