"""Fair shares of the engine's queue for ``parallm serve``: no one HTTP request, and no one API key, can
take the whole queue.

The unit is the *sequence*: one prompt sampled ``n`` times is ``n`` sequences (each is a row of the batch
and holds its own KV), so a completions request with 100 prompts and ``n=4`` costs 400. The limits are
shares of the engine's ``max_queue``:

- per request (``max_request_share``, default 1/4): a request costing more is refused with 400
  (``code="too_many_sequences"``); waiting would not help, the client must split it;
- per API key (``max_key_share``, default 1/2), when the server has several keys: a request that would
  take its key's sequences in flight over the share is refused with 429 and ``Retry-After``, while other
  keys are still served.

A lease is taken before anything is submitted and given back, synchronously and exactly once, when the
HTTP request ends however it ends (finished, failed, refused by the engine, client gone), so refused or
aborted work never holds a share that later requests then wait for.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable

from parallm_engine.serve.openai_format import APIError

DEFAULT_REQUEST_SHARE = 0.25
DEFAULT_KEY_SHARE = 0.5


class Lease:
    """Sequences held by one HTTP request; :meth:`release` gives them back (idempotent)."""

    def __init__(self, shares: "QueueShares | None", key: Hashable | None, cost: int):
        self._shares, self.key, self.cost = shares, key, cost

    def release(self) -> None:
        shares, self._shares = self._shares, None
        if shares is not None:
            shares._give_back(self.key, self.cost)


class QueueShares:
    """Per-request and per-key limits, in sequences, as shares of ``capacity()`` (the engine's
    ``max_queue``, read at each request so a changed bound applies at once)."""

    def __init__(self, capacity: Callable[[], int], request_share: float = DEFAULT_REQUEST_SHARE,
                 key_share: float = DEFAULT_KEY_SHARE, by_key: bool = True):
        for name, share in (("max_request_share", request_share), ("max_key_share", key_share)):
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {share!r}")
        self.capacity = capacity
        self.request_share = request_share
        self.key_share = key_share if by_key else None
        self._held: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def request_limit(self) -> int:
        return max(1, int(self.capacity() * self.request_share))

    def key_limit(self) -> int | None:
        return None if self.key_share is None else max(1, int(self.capacity() * self.key_share))

    def held(self, key: Hashable) -> int:
        with self._lock:
            return self._held.get(key, 0)

    def acquire(self, key: Hashable | None, cost: int, param: str = "prompt") -> Lease:
        """A lease on ``cost`` sequences for a request from ``key`` (None: keys are not told apart).
        Raises :class:`APIError` 400 when one request is over its limit, 429 when its key is."""
        limit = self.request_limit()
        if cost > limit:
            raise APIError(
                400, f"this request asks for {cost} sequences (prompts x n); one request may have at most "
                f"{limit} in flight ({self.request_share:g} of the engine queue): split it",
                param=param, code="too_many_sequences",
            )
        key_limit = self.key_limit()
        if key is None or key_limit is None:
            return Lease(None, None, cost)
        with self._lock:
            held = self._held.get(key, 0)
            if held + cost > key_limit:
                raise APIError(
                    429, f"this API key has {held} sequences in flight and may hold at most {key_limit} "
                    f"({self.key_share:g} of the engine queue); retry when some have finished",
                    type="rate_limit_error", code="key_share_exceeded", headers={"Retry-After": "1"},
                )
            self._held[key] = held + cost
        return Lease(self, key, cost)

    def _give_back(self, key: Hashable, cost: int) -> None:
        with self._lock:
            left = self._held.get(key, 0) - cost
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)
