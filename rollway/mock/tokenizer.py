"""A toy, deterministic tokenizer and chat template.

Text splits into pieces (a word or one punctuation character, with the whitespace before it), so the pieces of a
text always concatenate back to it. A piece's id is ``crc32(piece) % 50_000 + 100``; ids below 100 are special
tokens. The chat template is ``<|role|>content<|end|>`` per message, then ``<|assistant|>``.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

VOCAB_SIZE = 50_000
ID_OFFSET = 100

SPECIAL_TOKENS: dict[str, int] = {
    "<|bos|>": 1,
    "<|end|>": 2,
    "<|system|>": 3,
    "<|developer|>": 4,
    "<|user|>": 5,
    "<|assistant|>": 6,
    "<|tool|>": 7,
    "<|tools|>": 8,
    "<tool_call>": 9,
    "</tool_call>": 10,
}
SPECIAL_BY_ID: dict[int, str] = {v: k for k, v in SPECIAL_TOKENS.items()}
EOS = "<|end|>"
EOS_ID = SPECIAL_TOKENS[EOS]
TOOL_CALL_START_ID = SPECIAL_TOKENS["<tool_call>"]
TOOL_CALL_END_ID = SPECIAL_TOKENS["</tool_call>"]

_PIECE_RE = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")
_MAX_DECODE_TABLE = 500_000
_decode_table: dict[int, str] = {}


def pieces(text: str) -> list[str]:
    """Split ``text`` into token pieces; ``"".join(pieces(t)) == t``."""
    return _PIECE_RE.findall(text)


def piece_id(piece: str) -> int:
    special = SPECIAL_TOKENS.get(piece)
    if special is not None:
        return special
    token_id = ID_OFFSET + zlib.crc32(piece.encode("utf-8")) % VOCAB_SIZE
    if len(_decode_table) < _MAX_DECODE_TABLE:
        _decode_table.setdefault(token_id, piece)
    return token_id


def encode(text: str) -> list[int]:
    return [piece_id(p) for p in pieces(text)]


def decode(ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
    """Best effort: pieces this process has encoded decode to themselves, others to ``<|id|>``."""
    out: list[str] = []
    for token_id in ids:
        special = SPECIAL_BY_ID.get(token_id)
        if special is not None:
            if not skip_special_tokens:
                out.append(special)
        else:
            out.append(_decode_table.get(token_id, f"<|{token_id}|>"))
    return "".join(out)


def token_text(token_id: int) -> str:
    return decode([token_id])


def content_text(content: Any) -> str:
    """The text of a message ``content``: a string, None, or a list of parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif isinstance(part.get("refusal"), str):
                    texts.append(part["refusal"])
                else:
                    texts.append(f"[{part.get('type', 'part')}]")
        return "".join(texts)
    raise ValueError("content must be a string, null or a list of content parts")


def render_chat(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None = None) -> tuple[list[int], str]:
    """Token ids and text of the chat template applied to ``messages`` (with the generation prompt)."""
    ids: list[int] = []
    text: list[str] = []

    def special(tok: str) -> None:
        ids.append(SPECIAL_TOKENS[tok])
        text.append(tok)

    def plain(s: str) -> None:
        ids.extend(encode(s))
        text.append(s)

    if tools:
        special("<|tools|>")
        plain(json.dumps(tools, sort_keys=True, ensure_ascii=False))
        special(EOS)
    for message in messages:
        role = message["role"]
        header = f"<|{'tool' if role == 'function' else role}|>"
        if header in SPECIAL_TOKENS:
            special(header)
        else:  # a role the template does not know (vLLM passes any role on to the template)
            plain(header)
        plain(content_text(message.get("content")))
        for call in message.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                special("<tool_call>")
                plain(json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")}, ensure_ascii=False))
                special("</tool_call>")
        special(EOS)
    special("<|assistant|>")
    return ids, "".join(text)
