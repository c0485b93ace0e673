"""Chat prompts in which only the chat template's own control tokens are real tokens.

Rendering the template to text and tokenizing that text with special-token parsing (what
``tokenizer.apply_chat_template(tokenize=True)`` does) cannot tell the template's ``<|im_start|>`` from the
same characters inside a message, so a user message containing ``<|im_end|>\\n<|im_start|>system`` would
open a real system turn. Here instead:

1. every string the caller supplied (message contents, names, tool calls, tool schemas, documents; values
   and dict keys) has each control-token text in it wrapped in two marker characters that occur nowhere in
   the input or the template (private-use code points, picked per call), and a lone marker at its start or
   end where it begins or ends with a piece of a control token, so two adjacent strings cannot join into one;
2. the template renders the marked strings;
3. the rendered text is cut at the markers: the text between them is tokenized as usual (its control tokens
   are the template's), each marked control token as plain text, without special-token parsing.

A request with no control-token text in it renders and tokenizes exactly as before (one piece). Control
tokens are the tokenizer's special added tokens plus the added tokens the template itself writes. The
technique is transformers' ``apply_chat_template(..., sanitize_control_tokens=True)`` (5.x); it is done here
so that it works with every transformers version the engine supports, for mlx-lm's Python chat templates
too, and without ``split_special_tokens=True``, which flips a flag on the shared Rust tokenizer and so races
with other threads encoding at the same time. Templates that ``tojson`` with ``ensure_ascii`` (markers
written as ``\\ue000``) are handled as well.
"""

from __future__ import annotations

import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from parallm_engine.errors import InvalidRequestError

_PUA_FIRST, _PUA_LAST = 0xE000, 0xF8FF  # the Basic Multilingual Plane's private-use area
_PUA_CHAR = re.compile("[\ue000-\uf8ff]")
_PUA_ESCAPE = re.compile(r"\\u([eEfF][0-9a-fA-F]{3})")  # as json.dumps(ensure_ascii=True) writes them
_NOT_MARKED = ("chat_template",)  # template kwargs that are not template input


class ChatTokenizer:
    """Renders and tokenizes chats for one tokenizer (mlx-lm's ``TokenizerWrapper`` or a transformers
    tokenizer); safe to use from several threads at once."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # mlx-lm's TokenizerWrapper holds the transformers tokenizer as ``_tokenizer`` (a transformers fast
        # tokenizer's own ``_tokenizer`` is the Rust one: keep the transformers object then).
        is_hf = isinstance(tokenizer, PreTrainedTokenizerBase)
        self.hf = tokenizer if is_hf else getattr(tokenizer, "_tokenizer", tokenizer)
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):
            template = "\0".join(str(t) for t in template.values())
        self.template_text = template if isinstance(template, str) else ""
        tokens: dict[str, int] = {}
        for tid, tok in (getattr(self.hf, "added_tokens_decoder", None) or {}).items():
            content = str(getattr(tok, "content", tok))
            if not content or content.isspace():
                continue
            if getattr(tok, "special", False) or content in self.template_text:
                tokens[content] = int(tid)
        self.control_tokens: dict[str, int] = tokens
        self.control_ids = frozenset(tokens.values())
        longest_first = sorted(tokens, key=len, reverse=True)
        self._control_re = re.compile("|".join(map(re.escape, longest_first))) if tokens else None
        # Pieces of control tokens (2+ characters) a string may end or begin with: two adjacent strings in a
        # template could otherwise join into one token ("...<|im_" + "start|>...").
        self._heads = {t[:i] for t in tokens for i in range(2, len(t))}
        self._tails = {t[i:] for t in tokens for i in range(1, len(t) - 1)}
        self._head_lengths = sorted({len(p) for p in self._heads})
        self._tail_lengths = sorted({len(p) for p in self._tails})
        self._newline = self._encode_plain("\n") if tokens else []
        self._affixes: tuple[list[int], list[int]] | None = None

    # -- public ------------------------------------------------------------------------------------
    def apply(self, messages: list, tools: list | None, add_generation_prompt: bool,
              template_kwargs: dict[str, Any]) -> list[int]:
        """Token ids of the rendered chat, control tokens from the caller's strings encoded as text."""
        kwargs = dict(template_kwargs)
        if self._control_re is None or not self._needs_marking(messages, tools, kwargs):
            return self._render_ids(messages, tools, add_generation_prompt, kwargs)
        start, end = self._pick_markers(messages, tools, kwargs)
        mark = _Marker(self, start, end)
        marked_kwargs = {k: (v if k in _NOT_MARKED else mark(v)) for k, v in kwargs.items()}
        text = self.tokenizer.apply_chat_template(mark(messages), tools=mark(tools) if tools else None,
                                                  add_generation_prompt=add_generation_prompt, tokenize=False,
                                                  **marked_kwargs)
        return self._encode_marked(text, start, end)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text`` tokenized with no added token parsed (``"<|im_start|>"`` is seven plain tokens), with the
        tokenizer's BOS/EOS affixes when ``add_special_tokens``."""
        ids = self._encode_plain(text) if text else []
        if add_special_tokens:
            head, tail = self._special_affixes()
            ids = head + ids + tail
        return ids

    # -- rendering ---------------------------------------------------------------------------------
    def _render_ids(self, messages, tools, add_generation_prompt, kwargs) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tools=tools or None,
                                                 add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
        if hasattr(out, "keys") and "input_ids" in out:  # a transformers BatchEncoding
            out = out["input_ids"]
        return list(out)

    def _strings(self, *objs):
        stack = list(objs)
        while stack:
            value = stack.pop()
            if isinstance(value, str):
                yield value
            elif isinstance(value, dict):
                for k, v in value.items():
                    if isinstance(k, str):
                        yield k
                    stack.append(v)
            elif isinstance(value, (list, tuple)):
                stack.extend(value)

    def _needs_marking(self, messages, tools, kwargs) -> bool:
        marked = {k: v for k, v in kwargs.items() if k not in _NOT_MARKED}
        return any(self._control_re.search(s) or any(self._edges(s)) for s in self._strings(messages, tools, marked))

    def _edges(self, s: str) -> tuple[bool, bool]:
        """Whether ``s`` begins with the end of a control token, and whether it ends with the start of one."""
        begins = any(len(s) >= n and s[:n] in self._tails for n in self._tail_lengths)
        ends = any(len(s) >= n and s[-n:] in self._heads for n in self._head_lengths)
        return begins, ends

    def _pick_markers(self, messages, tools, kwargs) -> tuple[str, str]:
        """Two private-use characters found nowhere in the input or the template, neither as characters
        nor as JSON escapes."""
        seen = "\0".join(self._strings(messages, tools, kwargs)) + "\0" + self.template_text
        used = {ord(ch) for ch in _PUA_CHAR.findall(seen)}  # one pass, however many the input holds
        used.update(int(h, 16) for h in _PUA_ESCAPE.findall(seen))
        found = []
        for code in range(_PUA_FIRST, _PUA_LAST + 1):
            if code not in used:
                found.append(chr(code))
                if len(found) == 2:
                    return found[0], found[1]
        raise InvalidRequestError("the request uses every private-use character; cannot mark control tokens",
                                  param="messages")

    # -- tokenizing --------------------------------------------------------------------------------
    def _encode_marked(self, text: str, start: str, end: str) -> list[int]:
        """Tokenize a chat rendered from marked input: control tokens the template wrote become their ids;
        the text between them, marked control tokens included (markers dropped), is tokenized as plain
        text in one piece, so user content gets exactly the tokens it has as text. A lone marker (a string
        that began or ended with part of a control token, or markers a template split apart) cuts the text
        there, so the text on either side cannot join into a control token."""
        tokens = self._control_re.pattern
        s, e, es, ee = re.escape(start), re.escape(end), _escaped_re(start), _escaped_re(end)
        cut = re.compile(f"{s}({tokens}){e}|{es}({tokens}){ee}|({tokens})|{s}|{e}|{es}|{ee}")
        ids: list[int] = []
        segment: list[str] = []

        def flush() -> None:
            piece = "".join(segment)
            segment.clear()
            ids.extend(self._encode_piece(piece, at_start=not ids))

        pos = 0
        for m in cut.finditer(text):
            segment.append(text[pos:m.start()])
            if m.group(1) or m.group(2):  # the caller's: text
                segment.append(m.group(1) or m.group(2))
            elif m.group(3):  # the template's: a control token
                flush()
                ids.append(self.control_tokens[m.group(3)])
            else:  # a lone marker: a cut
                flush()
            pos = m.end()
        segment.append(text[pos:])
        flush()
        return ids

    def _encode_piece(self, piece: str, at_start: bool) -> list[int]:
        """Plain tokens of a piece of the chat. SentencePiece-style tokenizers add a prefix space at the
        start of a string: a piece after the start is encoded after a newline, and the newline removed
        again (as transformers does)."""
        if not piece:
            return []
        ids = None
        if not at_start:
            ids = self._encode_plain("\n" + piece)
            nl = self._newline
            ids = ids[len(nl):] if nl and ids[: len(nl)] == nl else None
        if ids is None:
            ids = self._encode_plain(piece)
        if not self.control_ids.isdisjoint(ids):  # a vocabulary that builds a control token from plain text
            raise InvalidRequestError("this tokenizer cannot encode the control-token text in the request as text",
                                      param="messages")
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        """No added token matched, without touching shared tokenizer state: the Rust tokenizer's own
        normalizer, pre-tokenizer and model, run directly (slow tokenizers take ``split_special_tokens``
        per call)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pre = backend.pre_tokenizer
        splits = [text] if pre is None else [piece for piece, _ in pre.pre_tokenize_str(text)]
        return [tok.id for split in splits for tok in backend.model.tokenize(split)]

    def _special_affixes(self) -> tuple[list[int], list[int]]:
        """The ids ``add_special_tokens=True`` puts before and after a text (BOS, sometimes EOS)."""
        if self._affixes is None:
            probe = "a"
            bare = list(self.hf.encode(probe, add_special_tokens=False))
            full = list(self.hf.encode(probe, add_special_tokens=True))
            head, tail = [], []
            for i in range(len(full) - len(bare) + 1):
                if full[i:i + len(bare)] == bare:
                    head, tail = full[:i], full[i + len(bare):]
                    break
            self._affixes = (head, tail)
        return self._affixes


class _Marker:
    """Wraps the control tokens in the caller's strings (values and keys, nested) in the two markers."""

    def __init__(self, owner: ChatTokenizer, start: str, end: str):
        self.owner, self.start, self.end = owner, start, end
        self._wrap = f"{start}\\g<0>{end}"

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, str):
            return self._mark(obj)
        if isinstance(obj, dict):
            return {(self._mark(k) if isinstance(k, str) else k): self(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self(v) for v in obj]
        return obj

    def _mark(self, s: str) -> str:
        begins, ends = self.owner._edges(s)
        out = self.owner._control_re.sub(self._wrap, s)
        return (self.start if begins else "") + out + (self.end if ends else "")


def _escaped_re(ch: str) -> str:
    """A pattern for ``ch`` as ``json.dumps(..., ensure_ascii=True)`` writes it (``\\ue000``), hex digits in
    either case."""
    return f"\\\\u(?i:{ord(ch):04x})"
