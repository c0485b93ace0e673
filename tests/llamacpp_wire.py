"""A loopback HTTP server that answers in llama.cpp's ``llama-server`` wire shapes, for the client-side
tests of ``base_url=`` where no llama-server binary is here (CI never has one; ``tests/test_clients.py``
runs the same checks against a real llama-server when one is found).

The shapes, as llama.cpp's server documents them (tools/server/README.md):

* ``POST /tokenize`` ``{"content": text, "add_special": bool}`` -> ``{"tokens": [ids]}``; a body without
  ``content`` (vLLM's ``{"prompt": ...}``) gets 200 and ``{"tokens": []}``.
* ``POST /apply-template`` ``{"messages": [...]}`` -> ``{"prompt": text}``.
* a prompt over the context: 400 ``{"error": {"code": 400, "message": "the request exceeds the available
  context size, try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": N,
  "n_ctx": M}}``.
* ``tool_choice`` ignored for chat templates without tool support: the answer is prose.

Token ids and the chat template are the real engine's (the default model), so counts are real counts.
``mode="vllm_errors"`` answers an over-long prompt in vLLM's wording instead; ``mode="no_tokens"`` answers
every /tokenize shape with no tokens (a server whose tokenizer endpoint reads neither shape).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

N_CTX = 512


class LlamaCppWire:
    def __init__(self, engine, mode: str = "llama.cpp"):
        self.engine, self.mode = engine, mode
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def _render(self, messages, tools=None) -> str:
        ids = self.engine.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        return self.engine.decode(ids)

    def _handler(self):
        wire = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.rstrip("/") in ("/v1/models", "/models"):
                    return self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
                self._send(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                path = self.path.rstrip("/")
                if path == "/tokenize":
                    text = body.get("content")
                    if wire.mode == "no_tokens" or not isinstance(text, str):
                        return self._send(200, {"tokens": []})
                    return self._send(200, {"tokens": wire.engine.encode(text, add_special_tokens=False)})
                if path == "/apply-template":
                    return self._send(200, {"prompt": wire._render(body["messages"], body.get("tools"))})
                if path == "/v1/chat/completions":
                    return self._chat(body)
                self._send(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

            def _chat(self, body: dict) -> None:
                n_prompt = len(wire.engine.encode(wire._render(body["messages"]), add_special_tokens=False))
                if n_prompt > N_CTX:
                    if wire.mode == "vllm_errors":
                        return self._send(400, {
                            "object": "error", "type": "BadRequestError", "param": None, "code": 400,
                            "message": f"This model's maximum context length is {N_CTX} tokens. However, you "
                                       f"requested {n_prompt} tokens in the messages. Please reduce the length."})
                    return self._send(400, {"error": {
                        "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": n_prompt, "n_ctx": N_CTX,
                        "message": "the request exceeds the available context size, try increasing it"}})
                answer = "It is sunny."  # prose: tool_choice is ignored, as llama-server does without tool support
                usage = {"prompt_tokens": n_prompt, "completion_tokens": 4, "total_tokens": n_prompt + 4}
                common = {"id": "chatcmpl-llamacpp-7", "created": 0, "model": "m", "system_fingerprint": "b6000-wire"}
                if not body.get("stream"):
                    return self._send(200, {**common, "object": "chat.completion", "usage": usage, "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]})
                chunks = [
                    {"index": 0, "delta": {"role": "assistant", "content": answer}, "finish_reason": None},
                    {"index": 0, "delta": {}, "finish_reason": "stop"},
                ]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for ch in chunks:
                    event = {**common, "object": "chat.completion.chunk", "choices": [ch]}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                event = {**common, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                self.wfile.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()

        return Handler
