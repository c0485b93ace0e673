"""The live page in a real browser (issue 76): headless Chromium (Debian's ``chromium``, driven by playwright's
Python package; ``scripts/setup`` installs both for the test extras) on ``/dashboard`` of a real server on
loopback with a key, while a 32-way fan-out and 4 agent-like multi-turn conversations run on the default model.

The page loads with no console error; its batch and timeline show the traffic within two seconds of the engine
having it; the prefix tree shows the shared system prompt with its hits; a client that disconnects mid-stream
ends its lane as aborted; the page reconnects after the server restarts. A screenshot is written to the test's
temporary directory (``PARALLM_UPDATE_SCREENSHOT=1``: to ``docs/images/dashboard.png``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from parallm_engine.serve.server import ServerThread, create_app

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the test extras) is not installed")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")

KEY = "page-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "You are one of many research agents. Reply with one short sentence and never use lists. " * 3
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DOCS_IMAGE = Path(__file__).resolve().parent.parent / "docs" / "images" / "dashboard.png"


async def _traffic(base: str) -> None:
    """32 single calls at once and 4 agents of 3 turns each (their own session), all sharing SYSTEM."""
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=300) as http:
        async def call(messages, session=None, max_tokens=24):
            body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
            r = await http.post("/v1/chat/completions", json=body,
                                headers={"x-session-id": session} if session else {})
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]

        async def agent(i):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Agent {i}: plan."}]
            for turn in range(3):
                reply = await call(messages, session=f"agent-{i}", max_tokens=16)
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Step {turn}."}]

        fan = [call([{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Fact {i}?"}])
               for i in range(32)]
        await asyncio.gather(*fan, *(agent(i) for i in range(4)))


def _disconnect_mid_stream(base: str) -> None:
    """A streaming call whose client goes away after its first chunks (its server request is aborted)."""
    body = {"model": "default", "stream": True, "max_tokens": 400, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell a very long story."}]}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120,
                      headers={**AUTH, "x-session-id": "agent-gone"}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break


def test_the_live_page_in_chromium(engine, tmp_path):
    srv = ServerThread(create_app(engine=engine, api_key=KEY)).start()
    port, errors = srv.port, []
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{srv.url}/dashboard?key={KEY}")
            page.wait_for_function("document.body.dataset.updated", timeout=10_000)

            traffic = threading.Thread(target=asyncio.run, args=(_traffic(srv.url),))
            traffic.start()
            # From the moment the engine has requests in flight, the page shows them within two seconds.
            deadline = time.monotonic() + 60
            while not httpx.get(f"{srv.url}/v1/status?sections=requests", headers=AUTH).json()["requests"]:
                assert time.monotonic() < deadline
            seen = time.monotonic()
            page.wait_for_selector("#batch tbody tr.row", timeout=2_000)
            page.wait_for_selector("#timeline .lane .bar", timeout=2_000)
            assert time.monotonic() - seen < 2.5  # (the two waits above, with the time between them)
            page.wait_for_function("document.querySelectorAll('#batch tbody tr.row').length >= 16", timeout=20_000)
            page.wait_for_selector('#timeline .lane[data-lane="agent-0"]', timeout=30_000)
            # Mid-traffic (some calls done, the agents' later turns still to come): every kind of bar on the page.
            page.wait_for_function("document.querySelectorAll('#timeline .lane[data-state=\"finished\"]').length >= 8",
                                   timeout=60_000)
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            busy = httpx.get(f"{srv.url}/v1/status?sections=engine", headers=AUTH).json()["engine"]
            print(f"a snapshot mid-traffic held the engine thread {busy['snapshot_ms']} ms "
                  f"({busy['rows_running']} rows decoding)")
            traffic.join(300)
            assert not traffic.is_alive()

            # The shared system prompt: one node of the tree, read from the cache by (nearly) every call.
            hits = page.eval_on_selector_all(
                ".tree-node[data-node]", "ns => ns.filter(n => n.querySelector('.tree-text').textContent"
                              ".includes('many research agents')).map(n => +n.dataset.hits)")
            assert hits and max(hits) >= 16, hits
            assert page.locator("#memory .mem-row").count() == 6
            assert errors == [], errors

            _disconnect_mid_stream(srv.url)
            page.wait_for_selector('#timeline .lane[data-lane="agent-gone"][data-state="aborted"]', timeout=15_000)
            page.wait_for_selector('#timeline .lane[data-lane="agent-gone"] .mark.abort', timeout=5_000)
            if os.environ.get("PARALLM_UPDATE_SCREENSHOT") == "1":
                shutil.copy(tmp_path / "dashboard.png", DOCS_IMAGE)

            # The server goes away and comes back on the same port: the page says so, then is live again.
            srv.stop()
            page.wait_for_function("document.getElementById('conn').textContent === 'reconnecting'", timeout=10_000)
            before = page.evaluate("document.body.dataset.updated")
            srv = ServerThread(create_app(engine=engine, api_key=KEY), port=port).start()
            page.wait_for_function(f"document.body.dataset.updated !== '{before}'", timeout=15_000)
            assert page.text_content("#conn") == "live"
            browser.close()
    finally:
        srv.stop()
