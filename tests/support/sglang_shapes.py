"""The key structure of a real SGLang 0.5.23's answers (its Python frontend, a tiny random Llama on CPU), copied from
the answers captured on this machine on 2026-11-28: each list is a JSON object's keys in the order the server sent
them; the file each comes from is named above it. The tests compare the mock's ``sglang`` flavour with these."""

from __future__ import annotations

# -- chat, not streamed (chat_nonstream, chat_unknown_field, chat_stoptoken, chat_nonstream_sglext) ----------------

CHAT_BODY = ["id", "object", "created", "model", "choices", "usage", "metadata"]
CHAT_BODY_WITH_SGLEXT = [*CHAT_BODY, "sglext"]
CHAT_CHOICE = ["index", "message", "logprobs", "finish_reason", "matched_stop"]
CHAT_CHOICE_WITH_TOKEN_IDS = [*CHAT_CHOICE, "prompt_token_ids", "response_token_ids"]
CHAT_CHOICE_WITH_META_INFO = [*CHAT_CHOICE, "meta_info"]
MESSAGE = ["role", "content", "reasoning_content"]
LOGPROB = ["token", "bytes", "logprob", "top_logprobs"]
TOP_LOGPROB = ["token", "bytes", "logprob"]
USAGE = [
    "prompt_tokens",
    "total_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "reasoning_tokens",
    "completion_tokens_details",
]
METADATA = ["weight_version", "weight_versions"]
WEIGHT_VERSION = ["version", "start", "end"]
SGLEXT = ["input_ids", "output_ids"]
META_INFO = [
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "input_token_logprobs",
    "output_token_logprobs",
    "output_token_logprobs_length",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_versions",
    "cached_tokens_details",
    "dp_rank",
    "e2e_latency",
    "response_sent_to_client_ts",
]

# -- chat, streamed (chat_stream_sglext, chat_stream_contusage, chat_stoptoken_stream, chat_stream_sglext_header_framed)

CHUNK = ["id", "object", "created", "model", "choices"]
CHUNK_WITH_USAGE = [*CHUNK, "usage"]
SGLEXT_CHUNK = [*CHUNK, "usage", "sglext"]
CHUNK_CHOICE = ["index", "delta", "logprobs", "finish_reason", "matched_stop"]
ROLE_DELTA = ["reasoning_content", "role", "content"]
CONTENT_DELTA = ["reasoning_content", "content"]
FINISH_DELTA = ["reasoning_content"]
#: The request header that frames the ids chunk as a named event, and the event's name.
FRAMED_EVENT = "sglext_ids"

# -- text completions (cmpl_nonstream, cmpl_stream, cmpl_stream_contusage) -----------------------------------------

COMPLETION_BODY = ["id", "object", "created", "model", "choices", "usage", "metadata"]
COMPLETION_CHOICE = ["index", "text", "logprobs", "finish_reason", "matched_stop"]
COMPLETION_CHOICE_WITH_TOKEN_IDS = [*COMPLETION_CHOICE, "token_ids", "prompt_token_ids"]
COMPLETION_LOGPROBS = ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
COMPLETION_CHUNK = ["id", "object", "created", "model", "choices", "usage"]
FIRST_COMPLETION_CHUNK_CHOICE = [*COMPLETION_CHOICE, "token_ids", "prompt_token_ids"]
COMPLETION_CHUNK_CHOICE = [*COMPLETION_CHOICE, "token_ids"]
COMPLETION_USAGE_CHUNK_USAGE = ["prompt_tokens", "total_tokens", "completion_tokens", "reasoning_tokens"]

# -- the Responses API (responses_nonstream, responses_stream) ---------------------------------------------------

RESPONSE = [
    "id",
    "object",
    "created_at",
    "model",
    "output",
    "status",
    "usage",
    "parallel_tool_calls",
    "tool_choice",
    "tools",
    "error",
    "incomplete_details",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "reasoning",
    "store",
    "temperature",
    "text",
    "top_p",
    "truncation",
    "user",
    "metadata",
]
RESPONSE_MESSAGE = ["id", "content", "role", "status", "type", "phase"]
OUTPUT_TEXT = ["annotations", "text", "type", "logprobs"]
RESPONSE_USAGE = ["input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details", "total_tokens"]
#: Each event's type and keys, in the order of a stream of one text delta that ran out of tokens.
RESPONSE_EVENTS = [
    ("response.created", ["type", "response", "sequence_number"]),
    ("response.in_progress", ["type", "response", "sequence_number"]),
    ("response.output_item.added", ["item", "output_index", "sequence_number", "type"]),
    ("response.content_part.added", ["content_index", "item_id", "output_index", "part", "sequence_number", "type"]),
    (
        "response.output_text.delta",
        ["content_index", "delta", "item_id", "logprobs", "output_index", "sequence_number", "type"],
    ),
    (
        "response.output_text.done",
        ["content_index", "item_id", "logprobs", "output_index", "sequence_number", "text", "type"],
    ),
    ("response.content_part.done", ["content_index", "item_id", "output_index", "part", "sequence_number", "type"]),
    ("response.output_item.done", ["item", "output_index", "sequence_number", "type"]),
    ("response.incomplete", ["type", "response", "sequence_number"]),
]

# -- GET routes (GET_*.body) ---------------------------------------------------------------------------------------

MODEL_INFO = [
    "model_path",
    "served_model_name",
    "tokenizer_path",
    "is_generation",
    "preferred_sampling_params",
    "weight_version",
    "load_format",
    "reasoning_parser",
    "tool_call_parser",
    "disaggregation_mode",
    "has_image_understanding",
    "has_audio_understanding",
    "model_type",
    "architectures",
    "embedding",
]
MODEL_CARD = ["id", "object", "created", "owned_by", "root", "parent", "max_model_len"]
#: The last keys of ``/server_info``, after the ~550 server arguments.
SERVER_INFO_TAIL = [
    "launch_command",
    "status",
    "max_total_num_tokens",
    "max_req_input_len",
    "startup_time",
    "hicache_object_layout",
    "kv_events",
    "internal_states",
    "version",
    "frontend",
]
#: Some server arguments, in the order ``/server_info`` lists them.
SERVER_ARGS_IN_ORDER = [
    "model_path",
    "tokenizer_path",
    "context_length",
    "dtype",
    "page_size",
    "device",
    "served_model_name",
    "enable_cache_report",
    "tool_call_parser",
    "stream_interval",
]
VERSION = "0.5.23"
NOT_FOUND = {"detail": "Not Found"}
ROOT = "SGLang is running"

# -- errors (errors_400_stream_tokenids.txt) ------------------------------------------------------------------------

ERROR = ["object", "message", "type", "param", "code"]
STREAMED_RETURN_TOKEN_IDS = {
    "object": "error",
    "message": "return_token_ids is not supported with streaming on /v1/chat/completions. Please set stream=false "
    "when using return_token_ids=true.",
    "type": "BadRequest",
    "param": None,
    "code": 400,
}
STREAMED_RETURN_PROMPT_TOKEN_IDS = {
    "object": "error",
    "message": "return_prompt_token_ids is not supported with streaming. Please set stream=false when using "
    "return_prompt_token_ids=true.",
    "type": "BadRequest",
    "param": None,
    "code": 400,
}
