"""``parallm top``: the live view in a terminal (issue 76), for users on SSH. It polls a running server's
``/v1/status`` (:mod:`parallm_engine.serve.live_routes`; ``parallm serve``, or an in-process engine's
``serve_dashboard``) and draws, with rich: the engine's figures and memory, the batch now (one line per row:
phase, queue position, tokens/s, pages, cached and generated tokens, pin), the most used prefixes of the radix
tree and the last calls. ``q`` quits (so does Ctrl-C); a server that goes away is retried, saying so."""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import time
import urllib.error
import urllib.request

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text


def status_url(url: str) -> str:
    """``/v1/status`` of the server at ``url`` (``http://host:port``, with or without ``/v1``)."""
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    return base + "/v1/status"


def fetch(url: str, api_key: str | None, timeout: float = 10.0) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310  (the user's own server URL)
        return json.load(r)


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render(snap: dict, url: str, rows_room: int = 20) -> Group:
    """The screen for one snapshot; ``rows_room``: the batch's lines at most (the rest counted)."""
    e = snap["engine"]
    head = Text.assemble((f"ParaLLM top  {e.get('model') or ''}", "bold"), f"  {url}   ", ("q", "bold"), " quits")
    disk = e.get("disk_tier")
    figures = Text(
        f"{e['tokens_per_s']:.1f} tok/s   rows: {e['rows_running']} decoding, {e['rows_prefilling']} prefilling, "
        f"{e['rows_waiting']} waiting   finished {e['requests_finished']}, aborted {e['requests_aborted']}, "
        f"preemptions {e['preemptions']}\n"
        f"memory: weights {_bytes(e['weight_bytes'])}, KV held {_bytes(e['kv_bytes_held'])} / "
        f"{_bytes(e['kv_budget_bytes'])}, prefix cache {_bytes(e['prefix_cache_bytes'])} "
        f"(hit rate {100 * e['prefix_cache_hit_rate']:.0f}%), pinned {e['pinned_sessions']} sessions "
        f"{_bytes(e['pinned_bytes'])}, disk tier "
        + (f"{_bytes(disk['bytes_written'])} written, {disk['hit_tokens']} tokens read back" if disk else "off"))
    batch = Table(title="batch now", title_justify="left", expand=True, pad_edge=False)
    for name, right in (("request", False), ("program", False), ("phase", False), ("queue", True), ("tok/s", True),
                        ("pages", True), ("cached", True), ("generated", True), ("pin", False)):
        batch.add_column(name, justify="right" if right else "left", no_wrap=True)
    style = {"decode": "blue", "prefill": "yellow", "queued": "dim"}
    rows = snap["requests"]
    for r in rows[:rows_room]:
        batch.add_row(r["id"] + (f"/{r['index']}" if r["index"] else ""), r["program"] or "-", r["phase"],
                      "" if r["queue_position"] is None else str(r["queue_position"]), f"{r['tokens_per_s']:.1f}",
                      str(r["pages"]), str(r["cached_tokens"]), str(r["generated_tokens"]),
                      "pinned" if r["pinned"] else "", style=style.get(r["phase"]))
    if len(rows) > rows_room:
        batch.caption = f"... and {len(rows) - rows_room} more rows"
    if not rows:
        batch.caption = "idle"
    parts = [head, figures, batch]
    tree = snap.get("tree")
    if tree and tree["nodes"]:
        prefixes = Table(title="most used prefixes", title_justify="left", expand=True, pad_edge=False)
        for name in ("prefix", "tokens", "hits", "programs"):
            prefixes.add_column(name, no_wrap=True, overflow="ellipsis", ratio=4 if name == "prefix" else 1)
        for n in sorted(tree["nodes"], key=lambda n: (n["hits"], n["program_count"]), reverse=True)[:5]:
            prefixes.add_row(n["text"].replace("\n", "\u23ce"), f"{n['tokens']} at {n['start_token']}",
                             str(n["hits"]), str(n["program_count"]))
        parts.append(prefixes)
    done = [r for r in snap.get("timeline", []) if r["finish_ago"] is not None][-5:]
    if done:
        last = Text("last calls: " + ", ".join(
            f"{r['id']}{' (' + r['program'] + ')' if r['program'] else ''} {r['finish_reason']} "
            f"{r['output_tokens']} tok" for r in reversed(done)))
        parts.append(last)
    return Group(*parts)


@contextlib.contextmanager
def _keys():
    """A function ``wait(seconds) -> key or None`` reading single keys from the terminal (cbreak mode), or
    sleeping where stdin is not a terminal."""
    if not sys.stdin.isatty() or os.name == "nt":
        yield lambda s: time.sleep(s)
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def wait(seconds: float):
        ready, _, _ = select.select([fd], [], [], seconds)
        return os.read(fd, 1).decode(errors="replace") if ready else None

    try:
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_top(url: str, api_key: str | None = None, interval: float = 1.0, console: Console | None = None) -> int:
    """Draw the live view of the server at ``url`` every ``interval`` seconds until ``q``; returns an exit code."""
    target = status_url(url)
    console = console or Console()
    with _keys() as wait, Live(Text("connecting to " + target), console=console, screen=True,
                               auto_refresh=False) as live:
        while True:
            try:
                snap = fetch(target, api_key)
                live.update(render(snap, url, rows_room=max(console.size.height - 20, 4)), refresh=True)
            except urllib.error.HTTPError as exc:
                if exc.code == 401:
                    live.stop()
                    console.print(f"error: {target} needs an API key (--api-key or PARALLM_API_KEY)")
                    return 2
                live.update(Text(f"{target}: HTTP {exc.code}; retrying"), refresh=True)
            except (OSError, ValueError, KeyError, TypeError) as exc:  # not reachable (restarting?), not ParaLLM
                live.update(Text(f"cannot read {target}: {exc}; retrying"), refresh=True)
            deadline = time.monotonic() + interval
            while (left := deadline - time.monotonic()) > 0:
                if wait(left) in ("q", "Q"):
                    return 0
