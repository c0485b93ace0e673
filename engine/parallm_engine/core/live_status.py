"""What the engine is doing now, for the live page, ``/v1/status`` and ``parallm top`` (issue 76).

:meth:`LiveStatus.snapshot` (any thread) reads the engine's published ``stats()``, its lifecycle recorder
(``Engine.timeline()``, ``timeline.py``: every request's queue / prefill / decode times, preemptions, how it
ended) and, between steps on the engine thread (``EngineCore.call``), every request in flight: its phase
(queued / prefill / decode), place in the queue, cached and generated tokens, pages held, whether its session is
pinned; and a bounded view of the radix tree (which programs' prompts pass through which prefix, and how many
requests read it from the cache). Between snapshots it keeps what rates need (tokens per second per row) and a
history of throughput, TTFT, ITL and queue depth. The tree's programs and hits are those the snapshots saw: a
request that starts and ends between two of them (a few per second while someone watches) has its bar on the
timeline but is not counted on the tree.

A request's ``program`` is ``timeline.program_of`` (today its session: ``Engine.submit(session=...)``, the
server's ``x-session-id`` / ``user``) or None; its ``lane`` on the timeline is its program, else its own id.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque

from parallm_engine.core.timeline import program_of

logger = logging.getLogger("parallm_engine")

#: Requests the timeline shows at most (the latest), and how far back (seconds) it and the history go.
MAX_FINISHED = 512
HISTORY_S = 300.0
HISTORY_STEP_S = 0.5  # the history's points (and the engine-wide tokens per second) at least this far apart
#: The prefix tree is shown to this many nodes (the largest first), each edge's text cut to PREVIEW_TOKENS.
MAX_TREE_NODES = 64
PREVIEW_TOKENS = 48
#: Snapshots closer together than this share one look at the engine thread (several viewers, one cost).
MIN_INTERVAL_S = 0.2
RECENT_S = 5.0  # the history's TTFT: of the calls whose first token came this many seconds before the point

_views: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_views_lock = threading.Lock()


def live_status(engine) -> "LiveStatus":
    """The one ``LiveStatus`` of ``engine`` (created on first use; every viewer shares it)."""
    with _views_lock:
        view = _views.get(engine)
        if view is None:
            view = _views[engine] = LiveStatus(engine)
        return view


class LiveStatus:
    """Snapshots of one engine for the live views (see the module docstring). Thread-safe."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self._lock = threading.Lock()
        self._rates: dict[str, tuple[float, int, float]] = {}  # in flight: (time, output tokens, tokens/s)
        # In flight and walked down the tree (their hit counted): the tree's shape at their last walk.
        self._walked: dict[str, tuple] = {}
        self._history: deque[dict] = deque()
        self._hits: dict[int, int] = {}  # radix node id -> requests that read it from the cache
        self._programs: dict[int, set] = {}  # radix node id -> programs (lanes) whose prompts pass through it
        self._previews: dict[int, str] = {}
        self._last: dict | None = None
        self._last_t = 0.0
        self._last_generated: tuple[float, int] | None = None
        self._tps = 0.0

    # -- any thread ---------------------------------------------------------------------------------
    def snapshot(self, *, max_age: float = MIN_INTERVAL_S, timeout: float = 10.0) -> dict:
        """The engine's state now: the last snapshot if it is at most ``max_age`` seconds old (viewers of a
        stream share one look), else a fresh one. Raises what the engine raises when it is not running
        (``EngineDeadError``)."""
        engine = self._engine()
        if engine is None:
            from parallm_engine.errors import EngineDeadError

            raise EngineDeadError("the engine is gone")
        with self._lock:
            if self._last is not None and time.monotonic() - self._last_t < max_age:
                return self._last
            core = engine.core
            live = core.call(lambda: self._look(core.scheduler, engine.tokenizer), timeout)
            stats = engine.stats()
            now = live["now"]
            page = stats.get("memory", {}).get("kv_page_tokens") or 0
            for r in live["rows"]:  # pages a row holds: its context's KV, in the pools' pages
                r["pages"] = -(-r["computed_tokens"] // page) if page and r["phase"] != "queued" else 0
            records = engine.timeline(since=now - HISTORY_S)["requests"][-MAX_FINISHED:]
            cached = {r["id"]: r["cached_tokens"] for r in live["rows"]}
            for r in records:  # the recorder has a request's cached tokens when it ends; in flight, its row's
                if r["finish"] is None and r["id"] in cached:
                    r["cached_tokens"] = cached[r["id"]]
            snap = {"time": time.time(), "engine": self._engine_part(engine, stats, live, records, now),
                    "requests": live["rows"], "timeline": [_record(r, now) for r in records], "tree": live["tree"],
                    "history": [{k: v for k, v in p.items() if k != "t"} for p in self._history]}
            self._last, self._last_t = snap, time.monotonic()
            return snap

    # -- the engine thread (inside core.call) -------------------------------------------------------
    def _look(self, sched, tokenizer) -> dict:
        now = time.monotonic()
        waiting = {id(s): i for i, s in enumerate(sched.waiting)}
        prefilling = {id(s) for s in sched.prefilling}
        running = {id(s) for s in sched.running}
        kv = sched.kv
        pins = getattr(getattr(kv, "sessions", None), "pins", None) or {}
        radix = sched.radix
        per_token = kv.kv_bytes_per_token or 0
        if radix is not None:
            tree_stats = radix.stats()
            shape = (tree_stats["nodes"], tree_stats["tokens"], tree_stats["evictions"])
        rows = []
        seen = set()
        for req in list(sched.requests.values()):
            seen.add(req.id)
            seqs = req.sequences or []
            generated = sum(len(getattr(s, "output_ids", ())) for s in seqs)
            t0, n0, tps = self._rates.get(req.id, (now, generated, 0.0))
            if now - t0 >= MIN_INTERVAL_S / 2:  # over at least half the snapshots' interval
                t0, n0, tps = now, generated, max(generated - n0, 0) / (now - t0)
            self._rates[req.id] = (t0, n0, tps)
            for s in seqs:
                sid = id(s)
                phase = "decode" if sid in running else "prefill" if sid in prefilling else "queued"
                computed = getattr(s, "computed", 0)
                rows.append({"id": req.id, "index": getattr(s, "index", 0), "program": program_of(req),
                             "phase": phase, "queue_position": waiting.get(sid),
                             "prompt_tokens": len(req.prompt_ids), "cached_tokens": getattr(s, "cached_tokens", 0),
                             "computed_tokens": computed, "kv_bytes": computed * per_token if phase != "queued" else 0,
                             "generated_tokens": len(getattr(s, "output_ids", ())),
                             "preemptions": getattr(s, "preemptions", 0), "priority": req.priority,
                             "pinned": req.session is not None and req.session in pins,
                             "age_s": round(now - req.arrival, 3), "tokens_per_s": round(tps / max(len(seqs), 1), 2)})
            if radix is not None and seqs and getattr(seqs[0], "started", False) and not seqs[0].embedding \
                    and self._walked.get(req.id) != shape:  # (the tree is as it was at its last walk: skip)
                self._walk(radix, seqs[0], program_of(req) or req.id, req.id not in self._walked)
                self._walked[req.id] = shape
        for rid in [r for r in self._rates if r not in seen]:
            del self._rates[rid]
        for rid in [r for r in self._walked if r not in seen]:
            del self._walked[rid]
        tree = None
        if radix is not None:
            try:
                tree = self._tree(radix, tokenizer, per_token)
            except Exception:  # noqa: BLE001  (a view must never stop the engine, nor fail the rest of it)
                logger.warning("could not read the prefix tree for the live view", exc_info=True)
        # What this look held the engine thread for (between two steps): the live view's cost to the engine.
        return {"now": now, "rows": rows, "tree": tree, "look_ms": round(1e3 * (time.monotonic() - now), 3)}

    def _walk(self, radix, seq, lane: str, count_hit: bool) -> None:
        """Follow ``seq``'s prompt down the tree (reading only): its ``lane`` on every node it passes, and (once
        per request: ``count_hit``) a hit on every node wholly inside the prefix it read from the cache."""
        node = radix.roots.get(seq.adapter_key)
        ids, i, n = seq.prompt_ids, 0, len(seq.prompt_ids)
        cached = seq.cached_tokens
        while node is not None and i < n:
            child = node.children.get(ids[i])
            if child is None:
                break
            edge = child.tokens
            if tuple(ids[i:i + len(edge)]) != edge:
                break
            i += len(edge)
            progs = self._programs.setdefault(child.id, set())
            if len(progs) < 64:
                progs.add(lane)
            if count_hit and i <= cached:
                self._hits[child.id] = self._hits.get(child.id, 0) + 1
            node = child

    def _tree(self, radix, tokenizer, per_token: int) -> dict:
        """The largest nodes (by tokens below them), parents before children, at most ``MAX_TREE_NODES``."""
        nodes, stack = [], [(c, 0) for root in radix.roots.values() for c in root.children.values()]
        while stack:
            node, depth = stack.pop()
            nodes.append((node, depth))
            stack.extend((c, depth + len(node.tokens)) for c in node.children.values())
        alive = {node.id for node, _ in nodes}
        if len(self._hits) > 4 * MAX_TREE_NODES or len(self._programs) > 16 * MAX_TREE_NODES:
            for table in (self._hits, self._programs, self._previews):
                for k in [k for k in table if k not in alive]:
                    del table[k]
        # Keep the nodes most worth seeing: read from the cache most, then in use, then the longest.
        ranked = sorted(nodes, key=lambda nd: (self._hits.get(nd[0].id, 0), nd[0].ref > 0, len(nd[0].tokens)),
                        reverse=True)[:MAX_TREE_NODES]
        shown = {node.id for node, _ in ranked}
        out = []
        for node, depth in sorted(ranked, key=lambda nd: nd[1]):
            parent = node.parent
            while parent is not None and parent.id not in shown:  # hang it on its nearest shown ancestor
                parent = parent.parent
            preview = self._previews.get(node.id)
            if preview is None:
                preview = self._previews[node.id] = _text(tokenizer, node.tokens[:PREVIEW_TOKENS])
            progs = self._programs.get(node.id, ())
            out.append({"id": node.id, "parent": parent.id if parent is not None and parent.parent is not None
                        else None, "start_token": depth, "tokens": len(node.tokens),
                        "bytes": node.nbytes or len(node.tokens) * per_token,
                        "in_use": node.ref, "hits": self._hits.get(node.id, 0), "programs": sorted(progs)[:16],
                        "program_count": len(progs), "text": preview})
        stats = radix.stats()
        return {"nodes": out, "total_nodes": stats["nodes"], "total_tokens": stats["tokens"],
                "bytes": stats["bytes"], "hit_rate": stats["hit_rate"], "shown": len(out)}

    # -- assembling ----------------------------------------------------------------------------------
    def _engine_part(self, engine, stats: dict, live: dict, records: list[dict], now: float) -> dict:
        mem = stats.get("memory", {})
        rows = live["rows"]
        generated = stats.get("generated_tokens", 0)
        prev = self._last_generated
        if prev is None or now - prev[0] >= HISTORY_STEP_S:  # rates over at least a history step
            self._tps = (generated - prev[1]) / (now - prev[0]) if prev is not None else 0.0
            self._last_generated = (now, generated)
        tps = self._tps
        # TTFT of the calls whose first token came in the last few seconds; ITL of the rows decoding now.
        ttft = [r["first_token"] - r["arrival"] for r in records
                if r["first_token"] is not None and now - r["first_token"] < RECENT_S]
        decoding = [tps for _, _, tps in self._rates.values() if tps > 0]
        point = {"ago": 0.0, "t": now, "tokens_per_s": round(tps, 2),
                 "ttft_s": round(sum(ttft) / len(ttft), 4) if ttft else None,
                 "itl_s": round(len(decoding) / sum(decoding), 4) if decoding else None,
                 "queue_depth": sum(1 for r in rows if r["phase"] == "queued"),
                 "running": sum(1 for r in rows if r["phase"] == "decode")}
        if not self._history or now - self._history[-1]["t"] >= HISTORY_STEP_S:
            self._history.append(point)
        while self._history and now - self._history[0]["t"] > HISTORY_S:
            self._history.popleft()
        for p in self._history:
            p["ago"] = round(now - p["t"], 3)
        cache = stats.get("prefix_cache", {})
        return {
            "model": stats.get("model"), "uptime_s": round(stats.get("uptime_s", 0.0), 3),
            "rows_running": sum(1 for r in rows if r["phase"] == "decode"),
            "rows_prefilling": sum(1 for r in rows if r["phase"] == "prefill"),
            "rows_waiting": sum(1 for r in rows if r["phase"] == "queued") + engine.core.pending,
            "queue_depth": stats.get("in_flight", 0), "max_queue": engine.max_queue,
            "tokens_per_s": round(tps, 2),
            "weight_bytes": stats.get("weight_bytes", 0),
            "kv_bytes_held": mem.get("kv_bytes_held", stats.get("kv_bytes_held", 0)),
            "kv_bytes_running": mem.get("kv_bytes_running", stats.get("kv_bytes", 0)),
            "kv_budget_bytes": mem.get("kv_budget_bytes"),
            "kv_page_tokens": mem.get("kv_page_tokens"),
            "prefix_cache_bytes": cache.get("bytes", mem.get("kv_bytes_prefix_cache", 0)),
            "prefix_cache_hit_rate": cache.get("hit_rate", 0.0),
            "pinned_sessions": mem.get("sessions_pinned", 0),
            "pinned_bytes": mem.get("sessions_pinned_bytes", 0),
            "disk_tier": ({"cap_bytes": mem.get("kv_disk_cap_bytes"), "hit_tokens": mem.get("kv_disk_hit_tokens", 0),
                           "bytes_read": mem.get("kv_disk_bytes_read", 0),
                           "bytes_written": mem.get("kv_disk_bytes_written", 0)}
                          if "kv_disk_cap_bytes" in mem else None),
            "preemptions": stats.get("preemptions", 0),
            "requests_finished": stats.get("requests_finished", 0),
            "requests_aborted": stats.get("requests_aborted", 0),
            "ttft_p50_s": stats.get("ttft_p50_s"), "itl_p50_s": stats.get("itl_p50_s"),
            "snapshot_ms": live["look_ms"],
        }


def _record(r: dict, now: float) -> dict:
    """A timeline record (``timeline.RequestRecord``) with its times as seconds before ``now``, and its lane."""
    ago = lambda t: None if t is None else round(now - t, 3)  # noqa: E731
    return {"id": r["id"], "program": r["program"], "lane": r["program"] or r["id"],
            "arrival_ago": ago(r["arrival"]), "admitted_ago": ago(r["admitted"]),
            "first_token_ago": ago(r["first_token"]), "finish_ago": ago(r["finish"]),
            "finish_reason": r["finish_reason"], "aborted": r["aborted"], "prompt_tokens": r["prompt_tokens"],
            "cached_tokens": r["cached_tokens"], "output_tokens": r["output_tokens"],
            "preemptions": len(r["preemptions"]), "preempted_ago": [ago(t) for t in r["preemptions"]]}


def _text(tokenizer, ids) -> str:
    try:
        return tokenizer.decode(list(ids))
    except Exception:  # noqa: BLE001  (a view must never stop the engine: show the ids instead)
        return " ".join(map(str, ids))
