"""Speculative decoding's draft-model method: a smaller model of the target's vocabulary proposes each
speculating row's next k tokens; the target verifies them in its batched step (``speculative.py``).

* Loading (:func:`resolve_draft`): once per process per draft (keyed by ``SpeculativeConfig.draft_key``:
  the resolved path, or a loaded model's identity), through the engine's own loader, on the thread that
  first asks (a request's submit, or ``Engine(speculative=...)``), so the engine thread never loads.
  Refused with :class:`InvalidRequestError` (``param="speculative"``, a 400 at the server): a draft that
  cannot be loaded, one whose vocabulary differs from the target's (vocabulary size, and the ids of a
  probe text and of EOS when the draft has a tokenizer), one whose caches are not all plain attention
  (sliding windows and recurrent state cannot be trimmed back after a rejection), vision models, and the
  target's own model object (the engine has switched its attention to its own batch caches).
* Proposals (:class:`DraftRows`, engine thread): each speculating row keeps its own draft KV (mlx-lm's
  ``KVCache`` per layer) and the tokens it holds. Before proposing, the KV is trimmed back to where it
  agrees with the row's context (after a rejection, the drafts the target did not accept) and the rest
  of the context is fed (the whole prompt the first time, in chunks; afterwards the few tokens accepted
  since). The draft proposes greedily (argmax): a deterministic proposal, for which the verification's
  test "accept d when the target's own draw equals d" is exact speculative rejection sampling (accepted
  with probability p(d), residual p without d), so sampled rows need no draft distribution q. The k
  forwards feed each argmax to the next forward lazily and everything is evaluated together: one host
  synchronisation per step. Rows of one draft model draft together: their caches are merged into
  mlx-lm's left-padded ``BatchKVCache`` for the k forwards (one forward per drafted position for the
  group) and extracted back to each row's own afterwards (copies of the draft KV, small next to the
  forwards they save; how wide a step drafts is the speculator's choice: ``spec_policy``).
* Memory: a row's draft KV is freed when the row leaves the batch (finished, cancelled, preempted:
  :meth:`DraftRows.drop`, called from the scheduler) and counted in ``spec_draft_kv_bytes`` and in the
  running rows' share of the KV budget (``KVManager``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from parallm_engine.errors import InvalidRequestError, ParaLLMError
from parallm_engine.kv.radix_cache import common_prefix_len

logger = logging.getLogger("parallm_engine")

#: Context tokens per draft forward when a row's draft KV catches up (its prompt, the first time).
PREFILL_CHUNK = 512
#: Text whose token ids the draft's and the target's tokenizers must agree on.
_PROBE = "Hello, world! The quick brown fox = {\"key\": [1, 2.5, null]} 😀 def f(x):\n\treturn x ** 2"


@dataclass
class DraftModel:
    """A loaded draft model (shared by every engine in the process that uses it)."""

    key: str
    model: object
    tokenizer: object | None  # None for a model passed in loaded
    vocab_size: int
    context_window: int
    name: str
    kernels: bool = False  # switched to the engine's CPU kernels (cpu_kernels.install)


_lock = threading.Lock()
_loaded: dict[str, DraftModel] = {}


def loaded_draft(key: str) -> DraftModel:
    """A draft model :func:`resolve_draft` has loaded (engine thread: requests are checked at submit)."""
    return _loaded[key]


def _speculative_error(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="speculative")


def _load(cfg) -> DraftModel:
    """The draft model for ``cfg`` (a draft SpeculativeConfig), loaded on first use."""
    with _lock:  # two first requests at once load it once
        found = _loaded.get(cfg.draft_key)
        if found is not None:
            return found
        model = cfg.model
        if isinstance(model, str) or hasattr(model, "__fspath__"):
            from parallm_engine.models.loader import load_model

            try:
                net, tokenizer, info = load_model(model)
            except ParaLLMError as exc:
                raise _speculative_error(f"speculative.model: {exc}") from exc
            draft = DraftModel(cfg.draft_key, net, tokenizer, info.vocab_size, info.context_window, info.name)
        else:
            args = getattr(model, "args", None)
            vocab = getattr(args, "vocab_size", None)
            if vocab is None:
                raise _speculative_error("speculative.model: a loaded draft model needs `args.vocab_size` "
                                         "(an mlx-lm model)")
            ctx = getattr(args, "max_position_embeddings", None) or 1 << 20
            draft = DraftModel(cfg.draft_key, model, None, int(vocab), int(ctx), type(model).__name__)
        _check_layout(draft)
        _loaded[cfg.draft_key] = draft
        logger.info("loaded draft model %s for speculative decoding", draft.name)
        return draft


def _check_layout(draft: DraftModel) -> None:
    from parallm_engine.kv.model_caches import cache_layout, layout_rolls_back

    if getattr(draft.model, "vision", None) is not None:
        raise _speculative_error(f"speculative.model: {draft.name} is a vision model; a draft must be a text model")
    model_type = str(getattr(getattr(draft.model, "args", None), "model_type", "") or "")
    try:
        layout = cache_layout(draft.model, model_type)
    except ParaLLMError as exc:
        raise _speculative_error(f"speculative.model: {exc}") from exc
    if not layout_rolls_back(layout):
        raise _speculative_error(
            f"speculative.model: draft model {draft.name} has sliding-window or recurrent layers (cache layout "
            f"{layout!r}); a draft's KV must be trimmable after rejections (plain attention only)")


def resolve_draft(cfg, target_model, target_tokenizer, target_info, kernels: bool = False) -> DraftModel:
    """The loaded draft model for ``cfg``, checked against this target; typed errors otherwise.
    ``kernels``: the engine runs the CPU kernels; the draft's modules are switched to them as the
    target's are (per instance, used only inside the engine's steps: ``cpu_kernels.install``)."""
    if cfg.model is target_model:
        raise _speculative_error("speculative.model: the target model object itself cannot be its draft "
                                 "(pass its path to load a separate copy)")
    draft = _load(cfg)
    if kernels and not draft.kernels:
        from parallm_engine.runner import cpu_kernels

        with _lock:
            if not draft.kernels:
                cpu_kernels.install(draft.model, min(draft.context_window, target_info.context_window))
                draft.kernels = True
    if draft.vocab_size != target_info.vocab_size:
        raise _speculative_error(
            f"speculative.model: draft vocabulary size {draft.vocab_size} differs from the target's "
            f"{target_info.vocab_size}; the draft must share the target's tokenizer")
    tok = draft.tokenizer
    if tok is not None:
        if tok.encode(_PROBE) != target_tokenizer.encode(_PROBE) or tok.eos_token_id != target_tokenizer.eos_token_id:
            raise _speculative_error(f"speculative.model: {draft.name}'s tokenizer differs from the target's "
                                     "(different token ids); the draft must share the target's tokenizer")
    return draft


def _catch_up(row: "_RowDraft", ctx: list[int]) -> None:
    """Trim the row's draft KV back to where it agrees with ``ctx`` (drafts the target rejected) and
    feed the rest of ``ctx`` but its last token (lazily). The catch-up needs only the KV: through the
    layers without the head where the model has them apart (mlx-lm's ``model.model``: the vocabulary
    projection of every position would cost more than a small draft's layers), in chunks (the prompt,
    the first time)."""
    agree = row.ctx_len + common_prefix_len(row.held[row.ctx_len :], ctx[row.ctx_len :])
    agree = min(agree, len(ctx) - 1)  # the last context token is fed again: its logits propose
    if len(row.held) > agree:
        for c in row.caches:
            c.trim(len(row.held) - agree)
        row.held = row.held[:agree]
    model = row.draft.model
    inner = getattr(model, "model", None)
    body = inner if callable(inner) and hasattr(inner, "layers") else model
    feed = ctx[agree:-1]
    while feed:
        body(mx.array(feed[:PREFILL_CHUNK])[None], cache=row.caches)
        feed = feed[PREFILL_CHUNK:]
        if feed:  # another chunk follows: this one's KV first (bounded memory)
            mx.eval([a for c in row.caches for a in (c.keys, c.values)])
    row.held = ctx[:-1]


def _greedy(model, caches: list, last: list[list[int]], k: int) -> list[mx.array]:
    """``k`` greedy steps from each row's last context token as one lazy graph (each step's argmax is
    the next forward's input): k arrays of one token per row."""
    tokens = mx.array(last)
    out = []
    for _ in range(k):
        tok = mx.argmax(model(tokens, cache=caches)[:, -1], axis=-1)
        out.append(tok)
        tokens = tok[:, None]
    return out


class _RowDraft:
    __slots__ = ("seq", "draft", "caches", "held", "ctx_len")

    def __init__(self, seq, draft: DraftModel):
        from mlx_lm.models.cache import make_prompt_cache

        self.seq, self.draft = seq, draft
        self.caches = make_prompt_cache(draft.model)
        self.held: list[int] = []  # the tokens whose KV the caches hold
        self.ctx_len = 0  # of those, a prefix known to be the row's context (it only grows)

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


class DraftRows:
    """Every speculating row's draft KV, and the proposals (engine thread only)."""

    def __init__(self):
        self._rows: dict[int, _RowDraft] = {}

    def propose(self, jobs: list[tuple]) -> list[list[int]]:
        """``jobs``: (sequence, DraftModel, k) per row; returns each row's k greedy draft tokens."""
        out: list[list[int]] = [[] for _ in jobs]
        groups: dict[int, list] = {}  # rows of one draft model draft together
        for i, (seq, draft, k) in enumerate(jobs):
            ctx = seq.request.prompt_ids + seq.output_ids
            k = min(k, draft.context_window - len(ctx))
            if k <= 0:
                continue
            row = self._rows.get(id(seq))
            if row is None or row.seq is not seq or row.draft is not draft:
                row = self._rows[id(seq)] = _RowDraft(seq, draft)
            _catch_up(row, ctx)
            groups.setdefault(id(draft), []).append((i, row, ctx, k))
        runs = []  # (rows, lazy draft tokens per step, merged caches or None)
        for group in groups.values():
            model = group[0][1].draft.model
            kmax = max(j[3] for j in group)
            if len(group) == 1 or any(len(ctx) + kmax > row.draft.context_window for _, row, ctx, _ in group):
                for job in group:
                    runs.append(([job], _greedy(model, job[1].caches, [[job[2][-1]]], job[3]), None))
                continue
            # One forward per drafted position for the whole group: the rows' caches merged left-padded.
            merged = [BatchKVCache.merge(list(layer)) for layer in zip(*(row.caches for _, row, _, _ in group))]
            runs.append((group, _greedy(model, merged, [[ctx[-1]] for _, _, ctx, _ in group], kmax), merged))
        mx.eval([t for _, toks, _ in runs for t in toks])
        for group, toks, merged in runs:
            drafted = mx.stack(toks, axis=1).tolist()  # (rows, positions)
            for b, (i, row, ctx, k) in enumerate(group):
                if merged is not None:
                    row.caches = [c.extract(b) for c in merged]
                row.held = ctx + drafted[b][:-1]  # the last draft was never fed
                row.ctx_len = len(ctx)
                out[i] = drafted[b][:k]
            if merged is not None:  # the rows' own copies now, not views keeping the merged arrays alive
                mx.eval([a for _, row, _, _ in group for c in row.caches for a in (c.keys, c.values)])
        return out

    def drop(self, seq_ids) -> None:
        """Free the draft KV of the sequences whose ``id()`` is in ``seq_ids`` (they left the batch)."""
        for i in seq_ids:
            self._rows.pop(i, None)

    def retain(self, running: list) -> None:
        """Free the draft KV of rows no longer running (a safety net for paths that skip :meth:`drop`)."""
        live = {id(s): s for s in running}
        for i in [i for i, r in self._rows.items() if live.get(i) is not r.seq]:
            del self._rows[i]

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self._rows.values())

    def __len__(self) -> int:
        return len(self._rows)
