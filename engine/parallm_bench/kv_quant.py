"""What KV quantization costs in accuracy: logprob drift on a model, teacher-forced.

Each text runs through the model twice with the engine's own per-sequence caches (``parallm_bench.sequence_kv.SequenceKV``),
once storing float KV and once quantized (``kv_quant``), in chunks of ``chunk`` tokens (the way a prompt is
prefilled: every later chunk reads the stored, quantized KV of the earlier ones). At every position we
compare the log-probability each run gives the text's actual next token, and whether the two runs'
top-1 tokens agree. Reported by the ``memory`` workload of `parallm bench` and bounded in
``tests/test_kv_quant.py``.
"""

from __future__ import annotations

import mlx.core as mx

from parallm_bench.sequence_kv import SequenceKV
from parallm_engine.kv.kv_quant import KVFormat

#: Texts of the drift measurement: prose, a list, code, a table (what agents read back).
DRIFT_TEXTS = (
    "The history of the city begins with a small fishing village on the river. Over three centuries it grew "
    "into a trading port, then an industrial centre, and today it is known for its universities, its museums "
    "and the old bridge that still carries traffic across the water every day.",
    "Shopping list: apples, bread, cheese, eggs, flour, grapes, honey, ice cream, jam, kiwis, lemons, milk, "
    "noodles, olives, pears, rice, salt, tomatoes, vinegar, water, yoghurt.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= "
    "b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n"
    "            j += 1\n    return out + a[i:] + b[j:]\n",
    "| city | population | area |\n|---|---|---|\n| Lyon | 522,000 | 47.9 |\n| Nantes | 320,000 | 65.2 |\n"
    "| Lille | 236,000 | 34.5 |\n| Nice | 342,000 | 71.9 |",
)


def _logprobs(model, ids: list[int], n_layers: int, fmt: KVFormat | None, chunk: int) -> mx.array:
    caches = [SequenceKV(fmt=fmt) for _ in range(n_layers)]
    parts = []
    for start in range(0, len(ids), chunk):
        logits = model(mx.array(ids[start : start + chunk])[None], cache=caches)
        parts.append(logits[0].astype(mx.float32))
        mx.eval(parts[-1])
    logits = mx.concatenate(parts)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def logprob_drift(model, tokenizer, n_layers: int, fmt: KVFormat, texts=DRIFT_TEXTS, chunk: int = 16) -> dict:
    """Mean / max |delta logprob| of the actual next token, and top-1 agreement, over every position."""
    deltas, agree, total = [], 0, 0
    for text in texts:
        ids = tokenizer.encode(text)
        ref = _logprobs(model, ids, n_layers, None, chunk)
        got = _logprobs(model, ids, n_layers, fmt, chunk)
        nxt = mx.array(ids[1:])
        rows = mx.arange(len(ids) - 1)
        deltas.append(mx.abs(ref[rows, nxt] - got[rows, nxt]))
        agree += int(mx.sum(mx.argmax(ref[:-1], axis=-1) == mx.argmax(got[:-1], axis=-1)))
        total += len(ids) - 1
    d = mx.concatenate(deltas)
    return {"bits": fmt.bits, "group_size": fmt.group_size, "positions": total,
            "mean_abs_logprob_drift": round(float(mx.mean(d)), 5),
            "max_abs_logprob_drift": round(float(mx.max(d)), 5),
            "top1_agreement": round(agree / total, 4)}
