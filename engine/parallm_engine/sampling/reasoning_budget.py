"""Reasoning spans token by token: how many tokens a sequence reasons for, and a budget that closes it.

The text of a reasoning span is split off by ``formats`` (``<think>...</think>``, harmony's analysis
channel). Here the same span is followed on token ids, one tracker per sequence, advanced by the output
processor with every token the sequence generates:

* ``tokens``: generated tokens inside the span (the markers themselves not counted): what
  ``usage.completion_tokens_details.reasoning_tokens`` reports.
* ``thinking_token_budget`` (``SamplingParams``): once ``tokens`` reaches it inside the span, the tracker
  forces the family's end of reasoning one token at a time (``forced()``): ``</think>`` for think markers;
  for harmony the end of the analysis message and the start of the final one
  (``<|end|><|start|>assistant<|channel|>final<|message|>``). The model then writes its answer. A forced
  token is the only one its row may sample (:func:`force_tokens`: the other logits of that row are -inf);
  other rows are not touched. After a forced close the budget is spent and nothing more is forced.

A forced token depends on the tokens just generated, so a row whose budget may still force one
(``live``) makes the decode step deliver the previous step before sampling (as grammar-constrained rows
do: the forward still runs while the host delivers), and it does not speculate.

A grammar (tools, ``response_format``) is the answer's: with think markers it neither masks nor sees the
reasoning span (the markers included), and the opening marker is allowed beside the grammar's tokens at the
start; harmony grammars spell out the channels themselves, so they see every token.
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx

_MAX_HEADER = 64  # harmony: a "header" longer than this many tokens without <|message|> is not one


class _Span:
    """What both families share: the count, the budget, the tokens being forced."""

    __slots__ = ("budget", "tokens", "inside", "done", "_force")

    def __init__(self, budget: int | None):
        self.budget = budget
        self.tokens = 0
        self.inside = False
        self.done = False  # the budget closed the span: nothing more is forced
        self._force: list[int] = []

    @property
    def live(self) -> bool:
        """Whether a next token may have to be forced (the row needs its previous token delivered first)."""
        return self.budget is not None and not (self.done and not self._force)

    def forced(self) -> int | None:
        return self._force[0] if self._force else None

    @property
    def frees_grammar(self) -> bool:
        """Whether a grammar constraint waits while the row reasons (think markers: the grammar is the
        answer's; harmony grammars cover the channels, analysis included)."""
        return False

    def opener(self) -> int | None:
        """A token that opens reasoning, to allow beside a grammar's tokens (None: none to allow now)."""
        return None

    def advance(self, token: int) -> bool:
        """Take the row's next token (never a stop token); returns whether it belongs to the reasoning span
        for the grammar: a token it does not see (see :attr:`frees_grammar`)."""
        was_free = self.frees_grammar
        if self._force:
            if self._force[0] == token:
                self._force.pop(0)
            else:  # not sampled under the force (cannot happen: the row allowed nothing else)
                self._force.clear()
        self._step(token)
        if self.inside and self.budget is not None and not self.done and self.tokens >= self.budget:
            self._force = list(self._close())
            self.done = True
        return was_free or self.frees_grammar

    def _step(self, token: int) -> None:
        raise NotImplementedError

    def _close(self) -> list[int]:
        raise NotImplementedError


class ThinkSpan(_Span):
    """``<think>`` / ``</think>`` style markers (each one token or a short token sequence)."""

    __slots__ = ("start", "end", "_recent", "_keep", "_seen")

    def __init__(self, start: tuple[int, ...], end: tuple[int, ...], inside: bool, budget: int | None):
        super().__init__(budget)
        self.start, self.end = start, end
        self.inside = inside
        self._recent: list[int] = []
        self._keep = max(len(start), len(end))
        self._seen = 0  # tokens generated
        if inside and budget == 0:  # a prompt that opened the span, and no reasoning allowed
            self._force, self.done = list(end), True

    def _close(self) -> list[int]:
        return list(self.end)

    @property
    def frees_grammar(self) -> bool:
        return self.inside or bool(self._force)

    def opener(self) -> int | None:
        """The start marker, before the first token (a model whose template leaves the opening to it)."""
        return self.start[0] if not self._seen and not self.inside and len(self.start) == 1 else None

    def _step(self, token: int) -> None:
        self._seen += 1
        self._recent.append(token)
        del self._recent[: -self._keep]
        if self.inside:
            if _ends_with(self._recent, self.end):
                self.inside = False
                self.tokens -= len(self.end) - 1  # its first tokens were counted as reasoning
            else:
                self.tokens += 1
        elif _ends_with(self._recent, self.start):
            self.inside = True


class HarmonySpan(_Span):
    """gpt-oss harmony: the body of a message on the ``analysis`` channel (not addressed to a tool)."""

    __slots__ = ("ids", "tokenizer", "close", "_mode", "_header")

    def __init__(self, ids: dict[str, int], tokenizer: Any, close: list[int], prompt_tail: list[int],
                 budget: int | None):
        super().__init__(budget)
        self.ids, self.tokenizer, self.close = ids, tokenizer, close
        self._mode = "text"  # "text" | "header" | "body"
        self._header: list[int] = []
        for t in prompt_tail:  # the generation prompt's open header (``<|start|>assistant``): not counted
            self._step(t)
        self.tokens = 0

    def _close(self) -> list[int]:
        return list(self.close)

    def _step(self, t: int) -> None:
        ids = self.ids
        if t == ids["<|start|>"] or (t == ids["<|channel|>"] and self._mode != "header"):
            self._mode, self._header, self.inside = "header", [t], False
        elif self._mode == "header":
            if t == ids["<|message|>"]:
                header = self.tokenizer.decode(self._header)
                self._mode = "body"
                self.inside = "<|channel|>analysis" in header.replace(" ", "") and "to=" not in header
            else:
                self._header.append(t)
                if len(self._header) > _MAX_HEADER:
                    self._mode, self._header = "text", []
        elif self._mode == "body":
            if t in (ids["<|end|>"], ids["<|return|>"], ids["<|call|>"]):
                self._mode, self.inside = "text", False
            elif self.inside:
                self.tokens += 1


_HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
_markers: dict[int, tuple[Any, Any]] = {}
_lock = threading.Lock()


def _family(tokenizer) -> Any:
    """("think", start ids, end ids) / ("harmony", ids, close ids) / None for this tokenizer (cached)."""
    key = id(tokenizer)
    with _lock:
        hit = _markers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    from parallm_engine.formats.chat_format import parser_for

    parser = parser_for(tokenizer)
    family = None
    ids = getattr(parser.tool_format, "marker_ids", None) or {}
    if parser.tool_format.handles_reasoning and all(m in ids for m in _HARMONY):
        try:
            close = [ids["<|end|>"], ids["<|start|>"], *tokenizer.encode("assistant", add_special_tokens=False),
                     ids["<|channel|>"], *tokenizer.encode("final", add_special_tokens=False), ids["<|message|>"]]
            family = ("harmony", {m: ids[m] for m in _HARMONY}, close)
        except Exception:
            family = None
    elif parser.think_ids is not None:
        family = ("think", parser, parser.think_ids)
    with _lock:
        _markers[key] = (tokenizer, family)  # holds the tokenizer, so its id is never reused meanwhile
    return family


def reasoning_span(tokenizer, prompt_ids: list[int], budget: int | None):
    """The tracker of a sequence that starts after ``prompt_ids``, or None for a model without reasoning
    markers (nothing to count, and a budget has nothing to close)."""
    if tokenizer is None:
        return None
    family = _family(tokenizer)
    if family is None:
        return None
    if family[0] == "think":
        parser, (start, end) = family[1], family[2]
        return ThinkSpan(start, end, bool(parser.starts_in_reasoning(prompt_ids)), budget)
    ids, close = family[1], family[2]
    tail = _from_last(prompt_ids, ids["<|start|>"])
    return HarmonySpan(ids, tokenizer, close, tail, budget)


def force_tokens(logits: mx.array, forced: list[int | None]) -> mx.array:
    """(B, V) logits where each row with a forced token allows only that token (the others -inf); rows
    with None are returned unchanged."""
    if all(t is None for t in forced):
        return logits
    target = mx.array([-1 if t is None else t for t in forced])[:, None]
    hit = mx.arange(logits.shape[-1])[None, :] == target
    # A forced token wins over a grammar that would not allow it (its logprob is then 0: it was certain).
    return mx.where(target < 0, logits, mx.where(hit, mx.where(mx.isinf(logits), 0.0, logits), -mx.inf))


def row_grammars(seqs: list) -> list:
    """Each row's grammar constraint to mask with now: None for finished rows and rows reasoning
    (:attr:`_Span.frees_grammar`)."""
    return [None if s.constraint is None or s.finish_reason is not None
            or (s.reasoning is not None and s.reasoning.frees_grammar) else s.constraint for s in seqs]


def row_openers(seqs: list) -> list[int | None]:
    """Each grammar-constrained row's reasoning opener to allow beside its grammar's tokens, or None."""
    return [s.reasoning.opener() if s.reasoning is not None and s.constraint is not None else None for s in seqs]


def allow_tokens(masked: mx.array, logits: mx.array, allowed: list[int | None]) -> mx.array:
    """``masked`` (by grammars) with each row's ``allowed`` token given its logit from ``logits`` again."""
    if all(t is None for t in allowed):
        return masked
    col = mx.array([-1 if t is None else t for t in allowed])[:, None]
    return mx.where(mx.arange(logits.shape[-1])[None, :] == col, logits, masked)


def forced_rows(seqs: list) -> list[int | None]:
    """Each sequence's forced next token (None: sampled freely; finished rows are never forced)."""
    return [s.reasoning.forced() if s.reasoning is not None and s.finish_reason is None else None for s in seqs]


def _ends_with(seq: list[int], tail: tuple[int, ...]) -> bool:
    return len(seq) >= len(tail) and tuple(seq[len(seq) - len(tail):]) == tuple(tail)


def _from_last(ids: list[int], token: int) -> list[int]:
    for i in range(len(ids) - 1, max(-1, len(ids) - 1 - 4 * _MAX_HEADER), -1):
        if ids[i] == token:
            return list(ids[i:])
    return []
