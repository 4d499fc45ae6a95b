"""``MockConfig``: the knobs of the mock backend (all but ``flavor`` changeable at runtime through ``POST
/mock/config``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

#: The engine the mock plays: vLLM 0.32 or SGLang 0.5.23 (its Python frontend).
Flavor = Literal["vllm", "sglang"]
FLAVORS: tuple[Flavor, ...] = ("vllm", "sglang")


@dataclass(frozen=True, slots=True)
class MockConfig:
    """How the mock backend behaves. Times are milliseconds."""

    #: The engine whose routes and answer shapes the mock reproduces; fixed when the mock starts.
    flavor: Flavor = "vllm"
    #: Model names listed by ``GET /v1/models``; with ``strict_models`` any other name is a 404 (like vLLM).
    models: tuple[str, ...] = ("mock-model",)
    strict_models: bool = False
    #: Waited before anything is sent (queueing, network).
    latency_ms: float = 0.0
    #: While true, generation requests wait on arrival (after their fault is chosen, before ``latency_ms``) until
    #: it is set back to false or the client leaves: a test keeps calls in flight for as long as it needs them
    #: there, instead of for a latency it hopes is long enough.
    hold: bool = False
    #: Waited after the response headers, before the first token (prefill).
    ttft_ms: float = 0.0
    #: Waited between two tokens of a choice (decode).
    token_delay_ms: float = 0.0
    #: ``max_tokens`` of chat and Responses calls that give none (completions default to 16, as OpenAI's).
    default_max_tokens: int = 256
    max_model_len: int = 32_768
    #: Share of sampled math answers (``A + B``) that are right; the others are off by one.
    math_accuracy: float = 0.7
    #: Length of embeddings when the request names no ``dimensions``.
    embedding_dim: int = 32
    #: Prefix-cache block size for ``cached_tokens`` (0 turns the simulated prefix cache off).
    prefix_block_size: int = 16
    #: Report ``usage.prompt_tokens_details`` (cached tokens) in chat and completions, as vLLM does when started
    #: with ``--enable-prompt-tokens-details`` (SGLang: ``--enable-cache-report``); off, they are null (both
    #: engines' default). The Responses API reports cached tokens either way.
    prompt_tokens_details: bool = False
    #: How many recent requests ``GET /mock/requests`` keeps.
    request_log_size: int = 1000
    #: SGLang's ``--tool-call-parser`` (``""``: none, SGLang's default and the captured server's). With one, the
    #: ``sglang`` flavour parses the fake model's ``<tool_call>`` markup into tool calls, whatever the name, and
    #: sends the logprobs of a streamed token that adds no text in a chunk of their own.
    tool_call_parser: str = ""
    #: vLLM's ``VLLM_SERVER_DEV_MODE=1``: the ``vllm`` flavour serves its weight routes (``rollway.mock.weights``);
    #: off, they are 404s, as on a vLLM started without it.
    dev_mode: bool = True

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}")

    def updated(self, changes: dict[str, Any]) -> MockConfig:
        """A copy with ``changes`` applied; unknown keys or wrong types raise ``ValueError``."""
        known = {f.name: f for f in dataclasses.fields(self)}
        clean: dict[str, Any] = {}
        for key, value in changes.items():
            if key not in known:
                raise ValueError(f"unknown config key {key!r}")
            current = getattr(self, key)
            if key in ("flavor", "dev_mode") and value != current:
                raise ValueError(f"{key} is fixed when the mock starts")
            if isinstance(current, str) and not isinstance(value, str):
                raise ValueError(f"{key} must be a string")
            if isinstance(current, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{key} must be a boolean")
            elif isinstance(current, int | float):
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise ValueError(f"{key} must be a non-negative number")
                value = type(current)(value)
            elif isinstance(current, tuple):
                if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value) or not value:
                    raise ValueError(f"{key} must be a non-empty list of strings")
                value = tuple(value)
            clean[key] = value
        return dataclasses.replace(self, **clean)

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["models"] = list(self.models)
        return data
