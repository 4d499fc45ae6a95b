"""What a request asks of the fake model, read from its body with vLLM's checks: the sampling parameters
(``sampling``), the stream options (``stream_options``) and the tool to call (``tool_spec``)."""

from __future__ import annotations

from typing import Any

from rollway.mock import validation as check
from rollway.mock.model import Sampling, ToolSpec
from rollway.mock.shapes import ToolMode
from rollway.mock.validation import rejected, schema_error


def sampling(body: dict[str, Any], max_tokens: int, n_prompt: int, max_model_len: int) -> Sampling:
    """The sampling parameters; ``max_tokens`` shrinks to what the context has left after the prompt."""
    check.sampling_ranges(body)
    check.prompt_length(n_prompt, max_model_len)
    return Sampling(
        max_tokens=max(1, min(max_tokens, max_model_len - n_prompt)),
        n=check.integer(body, "n") or 1,
        seed=check.integer(body, "seed"),
        temperature=check.number(body, "temperature"),
        min_tokens=check.integer(body, "min_tokens") or 0,
        ignore_eos=check.boolean(body, "ignore_eos"),
    )


def stream_options(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    options = check.mapping(body, "stream_options")
    if body.get("stream_options") is not None and not stream:
        raise rejected("Stream options can only be defined when `stream=True`.", "stream_options")
    return options


def tool_spec(body: dict[str, Any], *, flat: bool) -> tuple[ToolSpec | None, ToolMode]:
    """The tool to call (the first one, or the named one) and how it was asked for; None: answer with text.

    ``flat``: the Responses API's tools (``{"type": "function", "name": ...}``) and its messages."""
    tools = check.sequence(body, "tools") or []
    choice = body.get("tool_choice", "auto")
    named = isinstance(choice, dict)
    if not tools:
        if choice in ("auto", "none"):
            return None, "auto"
        if not flat:
            raise rejected("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if choice == "required":
            raise rejected("Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice")
        raise rejected("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        fn = tool if flat else (tool.get("function") if isinstance(tool, dict) else None)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            where = f"body.tools.{i}" + ("" if flat else ".function")
            raise schema_error(where + ".name" if isinstance(fn, dict) else where, "missing", "Field required", tool)
        params = fn.get("parameters")
        specs.append(ToolSpec(fn["name"], params if isinstance(params, dict) else {}))
    if choice == "none":
        return None, "auto"
    if named:
        wanted = choice.get("name") if flat else (choice.get("function") or {}).get("name")
        for spec in specs:
            if spec.name == wanted:
                return spec, "named"
        if flat:
            raise rejected("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        raise rejected("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")
    return specs[0], "required" if choice == "required" else "auto"
