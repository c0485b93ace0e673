"""Peak KV held by two agent turns on the default model (the figure in docs/design-paged-kv.md).

8 requests of 1,500 unique tokens decode 32 tokens each; then a second turn of each (its history, the
answer and 50 new tokens) hits the prefix cache. Prints each turn's peak ``kv_bytes_held`` over the KV
of the tokens in flight (1.0 = every byte held once, no slack) and the first tokens (same code, same
tokens). Run with ``.venv/bin/python scripts/measure_turn_memory.py``.
"""

import json
import random
import time

import parallm_engine  # noqa: F401  (preloads the BLAS before mlx)
from parallm_engine import Engine


def main() -> None:
    eng = Engine(None, decode_lanes=1)
    try:
        vocab = eng.model_info.vocab_size
        per_token = eng.model_info.kv_bytes_per_token()
        rng = random.Random(0)
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(1500)] for _ in range(8)]
        t0 = time.time()
        eng.reset_peaks()
        first = eng.generate(prompts, max_tokens=32, temperature=0, ignore_eos=True)
        turn1 = eng.stats()["peak_kv_bytes_held"] / (8 * (1500 + 32) * per_token)
        second = [p + r.token_ids + [rng.randrange(100, vocab - 100) for _ in range(50)]
                  for p, r in zip(prompts, first)]
        eng.reset_peaks()
        again = eng.generate(second, max_tokens=32, temperature=0, ignore_eos=True)
        turn2 = eng.stats()["peak_kv_bytes_held"] / (8 * (1500 + 32 + 50 + 32) * per_token)
        print(json.dumps({
            "turn1_peak_held_over_tokens": round(turn1, 3),
            "turn2_peak_held_over_tokens": round(turn2, 3),
            "turn2_cached_tokens": [r.usage.cached_tokens for r in again],
            "first_tokens": [r.token_ids[:4] for r in again[:2]],
            "seconds": round(time.time() - t0, 1),
        }))
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
