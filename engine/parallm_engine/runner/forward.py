"""Every forward of the engine's rows: the one module that calls the model for them.

A forward is the model on token ids and per-layer caches. Each row's own parts come from whoever owns
them, handed in here rather than wrapping the model: the rows' LoRA adapters (``lora.adapter_rows``), a
vision-language model's image embeddings and M-RoPE positions (its ``prefill_inputs`` / ``decode_kwargs``,
``vision/vlm.py``), and embedding rows' pooled states (the sequence's ``take``, ``embed/embedding.py``).

- ``prefill``: prompt rows, left-padded, each covering its own context positions.
- ``texts``: embedding texts alone, each whole: right-padded, no cache (their KV is never kept).
- ``decode``: running rows, one or more positions each, or one model row per position (a ragged step).
- ``fused``: decode rows and prompts' chunks in one forward through the model's hidden-state / head
  split (``logits_head``, ``kv/fused_step.py``); ``prompts``: such chunks alone.
- ``plain``: the compiled decode step's traced call (it applies only without adapters and per-row inputs).

Load-time probes (``logits_head``, ``kv_quant``) and other models (a draft model, a BERT encoder) call
their models themselves.

A distributed model (``distributed/sharding.py``; ``model.distributed_ranks`` set) has collectives inside
its forward. Each forward here is evaluated at once, its output included, so every rank runs them in the
same order whatever part of the step's results it reads first (a prompt's chunk whose logits nobody reads
would otherwise never send its activations on). Within :func:`micro_batched` (a pipeline's decode lanes,
its micro-batches) the forwards are built first and then evaluated stage first: every micro-batch's stage
(up to its send), in order, then every micro-batch's gather and head, in order. A rank then computes its
next micro-batch while the next rank computes the one it just sent, and every rank still runs the same
collectives in the same order.
"""

from __future__ import annotations

import contextlib
import time

import mlx.core as mx

from parallm_engine.runner.lora import adapter_rows


def _settled(model, out, cache: list | None = None):
    """``out``, evaluated now where ``model`` is distributed (see the module's docstring); the forward's shape
    and time go to its communication probe (``distributed/comm_probe.py``). Within :func:`micro_batched`:
    kept for its end, with what the pipeline stage computed for it and the stage's last cache (mlx-lm's
    pipeline ties its send to that cache's ``keys``)."""
    if getattr(model, "distributed_ranks", 0):
        stage = getattr(model, "stage_outputs", None)
        if stage is not None and stage.recording:
            tie = getattr(cache[-1], "keys", None) if cache else None
            stage.forwards.append((out, [*stage.items, *([tie] if isinstance(tie, mx.array) else [])]))
            stage.items = []
            return out
        _evaluated(model, out)
    return out


def _evaluated(model, out, seconds: float = 0.0) -> None:
    t0 = time.perf_counter()
    mx.eval(out)
    probe = getattr(model, "comm_probe", None)
    if probe is not None and hasattr(out, "shape"):
        probe.saw(out.shape, seconds + time.perf_counter() - t0)


@contextlib.contextmanager
def micro_batched(model, on: bool = True):
    """The forwards built inside, each a micro-batch of a distributed pipeline (its decode lanes), evaluated
    stage first at the end (see the module's docstring). Off (``on`` False, or not a pipeline): as outside."""
    stage = getattr(model, "stage_outputs", None)
    if not on or stage is None or not getattr(model, "distributed_ranks", 0):
        yield
        return
    stage.recording, stage.items, stage.forwards = True, [], []
    try:
        yield
    finally:
        stage.recording = False
        forwards, stage.forwards, stage.items = stage.forwards, [], []
        stage.most = max(stage.most, len(forwards))
    staged = []
    for _, targets in forwards:  # every micro-batch's stage, in order (a send leaves with its stage)
        t0 = time.perf_counter()
        mx.eval(targets)
        staged.append(time.perf_counter() - t0)
    for (out, _), seconds in zip(forwards, staged):  # then each one's gather and head, in order
        _evaluated(model, out, seconds)


def prefill(model, tokens: mx.array, cache: list, rows: list[tuple]) -> mx.array:
    """A prefill forward. ``rows``: one ``(sequence, start, n)`` per row of ``tokens`` (left-padded to
    ``tokens.shape[1]``): the row covers context positions ``[start, start + n)``. A batch with embedding
    rows runs the hidden-state forward (no head), and each embedding row pools its own positions."""
    seqs = [seq for seq, _, _ in rows]
    inputs = getattr(model, "prefill_inputs", None)
    with adapter_rows(model, seqs):
        ids, kwargs = inputs(tokens, rows) if inputs is not None else (tokens, {})
        if not any(seq.embedding for seq in seqs):
            return _settled(model, model(ids, cache=cache, **kwargs))
        hidden = _settled(model, model.model(ids, cache=cache, **kwargs))
    L = tokens.shape[1]
    for r, (seq, start, n) in enumerate(rows):
        if seq.embedding:
            seq.take(hidden[r, L - n :], start)
    return hidden


def texts(model, tokens: mx.array, seqs: list, lengths: list[int]) -> None:
    """Embedding texts alone, each whole in this forward: ``tokens`` right-padded (with causal attention no
    position reads a pad after it), the hidden-state forward with no cache (nothing is kept, so no KV is
    written), each row pooling its own ``lengths[i]`` positions."""
    with adapter_rows(model, seqs):
        hidden = _settled(model, model.model(tokens))
    for r, (seq, n) in enumerate(zip(seqs, lengths)):
        seq.take(hidden[r, :n], 0)


def pooled(seqs: list) -> list[mx.array]:
    """What a prefill's ``mx.eval`` must also compute: its embedding rows' pooled states so far."""
    return [s.pooled for s in seqs if s.embedding and s.pooled is not None]


def decode(model, tokens: mx.array, cache: list, seqs: list, positions: list[int] | None = None) -> mx.array:
    """The logits of running rows ``seqs``: ``tokens`` (B, W), W positions per row, with the model's per-row
    extras (an M-RoPE model's positions); or a ragged step, ``positions[i]`` model rows of sequence i, one
    position each (``tokens`` (sum, 1); the positions come from the caches)."""
    hook = getattr(model, "decode_kwargs", None) if positions is None else None
    kwargs = hook(seqs, tokens.shape[1]) if hook is not None else {}
    with adapter_rows(model, seqs, positions):
        return _settled(model, model(tokens, cache=cache, **kwargs), cache)


def prompts(model, ids: mx.array, cache: list, seqs: list) -> None:
    """Prompts' chunks alone (a lane with fused work and no decode rows): their KV written, logits unread."""
    with adapter_rows(model, seqs):
        _settled(model, model(ids, cache=cache), cache)


def fused(split, model, tokens: mx.array, cache: list, decode_seqs: list, prompt_seqs: list,
          new: list[int]) -> mx.array:
    """Decode rows ``decode_seqs`` (the first ``len(decode_seqs)`` rows of ``tokens``, one position each) and
    prompts' chunks (``new[i]`` rows of ``prompt_seqs[i]``, one position each) in one hidden-state forward;
    the head (``split``: the model's exact ``(backbone, head)``) on the decode rows only."""
    backbone, head = split
    B = len(decode_seqs)
    with adapter_rows(model, decode_seqs + prompt_seqs, [1] * B + new):
        hidden = _settled(model, backbone(tokens, cache=cache), cache)
    with adapter_rows(model, decode_seqs):
        return head(hidden[:B])


def plain(model, tokens: mx.array, cache: list) -> mx.array:
    """The model's own forward, nothing bound (the compiled decode step's trace)."""
    return _settled(model, model(tokens, cache=cache))
