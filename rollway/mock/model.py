"""The fake model: deterministic choices (text, math answers, tool calls) and their logprobs.

Every choice is a list of tokens; each token says what it adds to the message (a content piece, a tool-call
header, a piece of the tool-call arguments). Streaming sends one chunk per token; a non-streamed answer is the
fold of the same deltas, so both always agree.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rollway.mock import tokenizer as tok

_WORD_LIST = (
    "the a model agent reward token policy value sample rollout batch step gradient signal answer question tool "
    "result plan search check think learn update return state action trace span store queue runner worker train "
    "data loop fast slow simple clear small large good better next first last each every more less now then here "
    "there because so and but with without into over under about through after before while"
)
WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())

_MATH_RE = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)")


@dataclass(frozen=True, slots=True)
class Token:
    id: int
    #: The token as a logprob entry shows it.
    text: str
    #: What the token adds to ``message.content`` (``None``: nothing, the delta stays empty).
    content: str | None = None
    #: What the token adds to the tool call's ``arguments``.
    arguments: str | None = None
    #: This token completes the tool's name: its delta opens the tool call (id, type, name).
    opens_tool_call: bool = False


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class Choice:
    index: int
    tokens: list[Token]
    finish_reason: str
    salt: str
    tool_call: ToolCall | None = None
    #: What came before the first token (``context``): a token's logprob depends on it and the tokens before the
    #: token only, as a language model's does, so scoring prompt and answer as one prompt gives the same values.
    context: bytes = b""
    _states: list[bytes] = field(default_factory=list, repr=False)

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    @property
    def content(self) -> str:
        return "".join(t.content or "" for t in self.tokens)

    @property
    def text(self) -> str:
        """Completions' text: every token but special ones."""
        return "".join(t.text for t in self.tokens if t.id not in tok.SPECIAL_BY_ID)

    @property
    def arguments(self) -> str:
        return "".join(t.arguments or "" for t in self.tokens)

    @property
    def has_tool_call(self) -> bool:
        return any(t.opens_tool_call for t in self.tokens)

    @property
    def raw_text(self) -> str:
        """The output as the engine decodes it: every token but the end-of-sequence one (tool-call markup too)."""
        return "".join(t.text for t in self.tokens if t.id != tok.EOS_ID)

    @property
    def parsed_call(self) -> ToolCall | None:
        """The tool call a parser finds in the whole output: none when ``max_tokens`` cut it before its end."""
        if self.tool_call is None or tok.TOOL_CALL_END_ID not in self.token_ids:
            return None
        return self.tool_call

    @property
    def unparsed(self) -> bool:
        """The output holds the markup of a tool call the parser cannot read (``max_tokens`` cut it): the whole
        output is then the message's text."""
        return tok.TOOL_CALL_START_ID in self.token_ids and self.parsed_call is None

    def _state(self, position: int) -> bytes:
        """The context followed by the first ``position`` tokens (``extended``, kept as it grows)."""
        states = self._states or [self.context]
        while len(states) <= position:
            states.append(extended(states[-1], [self.tokens[len(states) - 1].id]))
        self._states = states
        return states[position]

    def logprob(self, position: int, top: int) -> tuple[float, list[tuple[str, float]]]:
        """The sampled token's logprob and the ``top`` most likely tokens at ``position`` (best first)."""
        token = self.tokens[position]
        key = self._state(position) + struct.pack("<i", token.id)
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        value = -round(0.0005 + 2.5 * (seed / 2**64) ** 3, 6)
        alternatives: list[tuple[str, float]] = [(token.text, value)]
        if top <= 1:
            return value, alternatives[:top]
        rng = random.Random(seed)
        current = value
        for word in rng.sample(WORDS, top):
            if len(alternatives) >= top:
                break
            candidate = " " + word
            if candidate == token.text:
                continue
            current = round(current - 0.25 - 2.0 * rng.random(), 6)
            alternatives.append((candidate, current))
        return value, alternatives[:top]


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    n: int = 1
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def prompt_digest(prompt_ids: list[int]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(prompt_ids)}i", *prompt_ids), digest_size=12).hexdigest()


def extended(state: bytes, ids: list[int]) -> bytes:
    """A context followed by ``ids``: a chain of digests, so that a context is a function of its tokens alone."""
    for token_id in ids:
        state = hashlib.blake2b(state + struct.pack("<i", token_id), digest_size=16).digest()
    return state


def start_of(weights: str) -> bytes:
    """The context before any token: the loaded weights (a reload changes every logprob)."""
    return hashlib.blake2b(f"weights:{weights}".encode(), digest_size=16).digest()


def prompt_choice(prompt_ids: list[int], weights: str = "") -> Choice:
    """The prompt's tokens as a choice, to score them like generated ones."""
    tokens = [Token(id=i, text=tok.decode([i])) for i in prompt_ids]
    return Choice(0, tokens, "", prompt_digest(prompt_ids), context=start_of(weights))


def math_problem(text: str) -> tuple[int, str] | None:
    """``(right answer, expression)`` of the first ``A + B`` / ``A - B`` / ``A * B`` in ``text``."""
    match = _MATH_RE.search(text)
    if match is None:
        return None
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return value, f"{a} {op} {b}"


def _sentence(rng: random.Random, words: int) -> str:
    chosen = [rng.choice(WORDS) for _ in range(words)]
    chosen[0] = chosen[0].capitalize()
    return " ".join(chosen) + "."


def _text_tokens(text: str) -> list[Token]:
    return [Token(id=tok.piece_id(p), text=p, content=p) for p in tok.pieces(text)]


def _fill_arguments(schema: dict[str, Any], rng: random.Random, user_text: str) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    required = schema.get("required") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not isinstance(required, list):
        return {}
    problem = math_problem(user_text)
    words = re.findall(r"\w+", user_text)
    phrase = problem[1] if problem else " ".join(words[:3]) if words else rng.choice(WORDS)
    args: dict[str, Any] = {}
    for name in required:
        prop = props.get(name)
        spec = prop if isinstance(prop, dict) else {}
        kind = spec.get("type")
        if isinstance(spec.get("enum"), list) and spec["enum"]:
            args[name] = spec["enum"][0]
        elif kind == "integer":
            args[name] = rng.randint(1, 10)
        elif kind == "number":
            args[name] = round(rng.uniform(0, 10), 2)
        elif kind == "boolean":
            args[name] = True
        elif kind == "array":
            args[name] = []
        elif kind == "object":
            args[name] = {}
        else:
            args[name] = phrase
    return args


class FakeModel:
    """Chooses answers from the prompt, deterministically."""

    def __init__(self, *, math_accuracy: float = 0.7, weights: str = "") -> None:
        self.math_accuracy = math_accuracy
        #: Which weights are loaded ("" for the ones it started with): a reload changes every answer.
        self.weights = weights

    def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        *,
        user_text: str,
        tool: ToolSpec | None = None,
    ) -> list[Choice]:
        digest = prompt_digest(prompt_ids)
        context = extended(start_of(self.weights), prompt_ids)
        choices: list[Choice] = []
        for index in range(sampling.n):
            salt = f"{digest}:{sampling.seed}:{sampling.temperature}:{index}"
            if self.weights:
                salt += f":{self.weights}"
            rng = random.Random(_seed(salt))
            if tool is not None:
                choice = self._tool_choice(index, salt, rng, sampling, tool, user_text)
            else:
                choice = self._text_choice(index, salt, rng, sampling, user_text)
            choice.context = context
            choices.append(choice)
        return choices

    def _text_choice(self, index: int, salt: str, rng: random.Random, sampling: Sampling, user_text: str) -> Choice:
        problem = math_problem(user_text)
        if problem is not None:
            value = problem[0]
            if rng.random() >= self.math_accuracy:
                value += rng.choice((-1, 1))
            text = f"The answer is {value}."
        else:
            text = _sentence(rng, rng.randint(4, 12))
        tokens = _text_tokens(text)
        want = sampling.max_tokens if sampling.ignore_eos else sampling.min_tokens
        while len(tokens) < want:
            tokens.extend(_text_tokens(" " + _sentence(rng, rng.randint(4, 12))))
        return self._finish(Choice(index, tokens, "stop", salt), sampling)

    def _tool_choice(
        self, index: int, salt: str, rng: random.Random, sampling: Sampling, tool: ToolSpec, user_text: str
    ) -> Choice:
        call_id = "chatcmpl-tool-" + hashlib.blake2b(salt.encode(), digest_size=8).hexdigest()  # vLLM's form
        arguments = json.dumps(_fill_arguments(tool.parameters, rng, user_text), ensure_ascii=False)
        name_pieces = tok.pieces(tool.name) or [tool.name]
        tokens = [Token(id=tok.TOOL_CALL_START_ID, text="<tool_call>")]
        for i, piece in enumerate(name_pieces):
            tokens.append(Token(id=tok.piece_id(piece), text=piece, opens_tool_call=i == len(name_pieces) - 1))
        tokens.extend(Token(id=tok.piece_id(p), text=p, arguments=p) for p in tok.pieces(arguments))
        tokens.append(Token(id=tok.TOOL_CALL_END_ID, text="</tool_call>"))
        choice = self._finish(Choice(index, tokens, "tool_calls", salt), sampling)
        if choice.has_tool_call:
            choice.tool_call = ToolCall(id=call_id, name=tool.name, arguments=choice.arguments)
        return choice

    @staticmethod
    def _finish(choice: Choice, sampling: Sampling) -> Choice:
        """Cut the choice at ``max_tokens``, or end it with the end-of-sequence token (which adds nothing)."""
        if sampling.ignore_eos or len(choice.tokens) + 1 > sampling.max_tokens:
            del choice.tokens[sampling.max_tokens :]
            choice.finish_reason = "length"
        else:
            choice.tokens.append(Token(id=tok.EOS_ID, text=tok.EOS))
        return choice


class PrefixCache:
    """Simulated prefix caching: ``cached_tokens`` is the longest run of full blocks seen before (never all)."""

    def __init__(self, block_size: int, capacity: int = 200_000) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def lookup_and_insert(self, namespace: str, ids: list[int]) -> tuple[int, int]:
        """``(cached, written)``: the prompt tokens found in the cache, and those this prompt added to it."""
        size = self.block_size
        if size <= 0:
            return 0, 0
        chained = namespace.encode("utf-8")
        cached = 0
        hit = True
        for end in range(size, len(ids) + 1, size):
            block = ids[end - size : end]
            chained = hashlib.blake2b(chained + struct.pack(f"<{size}i", *block), digest_size=16).digest()
            if hit and chained in self._seen and end < len(ids):
                cached = end
                self._seen.move_to_end(chained)
            else:
                hit = False
                self._seen[chained] = None
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return cached, len(ids) // size * size - cached

    def clear(self) -> None:
        self._seen.clear()
