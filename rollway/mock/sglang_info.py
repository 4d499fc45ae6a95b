"""SGLang 0.5.23's own routes, as its Python frontend answers them (``http_server.py``): what a client reads to
tell the engine (``/get_model_info``, ``/server_info``, ``/v1/models``; SGLang has no ``/version``).

``/server_info`` holds about 560 keys on a real server: every resolved server argument, then ``launch_command``,
``status``, ``max_total_num_tokens``, ``max_req_input_len``, ``startup_time``, ``internal_states`` (the scheduler's
copy of the arguments and its memory figures), ``version`` and ``frontend``. The mock answers a subset of the
arguments, in the captured order, and every key after them.
"""

from __future__ import annotations

import time
from typing import Any

from rollway.mock.config import MockConfig
from rollway.mock.identity import SGLANG_VERSION

#: The model's features SGLang reports under ``embedding`` (a generation model: every one off).
_EMBEDDING = {
    "family": "none",
    "task": "none",
    "execution": "none",
    "attention": "none",
    "pooling": "model_defined",
    "normalize": False,
    "postprocessor": "none",
    "tokenizer_special_tokens": "model_default",
    "supports_dimensions": False,
    "supports_token_embeddings": False,
    "supports_multimodal": False,
    "requires_embedding_flag": False,
    "auto_enable_embedding": False,
    "bcg_eligibility": "disabled",
    "safe_disable_kv_cache": False,
    "safe_disable_radix_cache": False,
    "safe_disable_chunked_prefill": False,
    "enabled": False,
    "matryoshka_dimensions": [],
    "bcg": {"prefill_backend": "disabled", "enabled": False, "capture_token_budget": 4096, "capture_batch_sizes": []},
    "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False, "chunked_prefill_disabled": False},
}
#: The tokens SGLang keeps of the context for the engine's own (``max_req_input_len``: 1018 of 1024).
_RESERVED = 6
_STARTUP = {"load_weight": 0.01, "kv_cache_allocation": 0.4, "scheduler_e2e": 1.96}


def model_info(config: MockConfig) -> dict[str, Any]:
    """``GET /model_info`` (and ``/get_model_info``)."""
    model = config.models[0]
    return {
        "model_path": model,
        "served_model_name": model,
        "tokenizer_path": model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": config.tool_call_parser or None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "embedding": _EMBEDDING,
    }


def _server_args(config: MockConfig) -> dict[str, Any]:
    model = config.models[0]
    parser = config.tool_call_parser or None
    return {
        "model_path": model,
        "tokenizer_path": model,
        "tokenizer_mode": "auto",
        "skip_tokenizer_init": False,
        "load_format": "auto",
        "trust_remote_code": False,
        "context_length": config.max_model_len,
        "is_embedding": False,
        "dtype": "auto",
        "kv_cache_dtype": "auto",
        "mem_fraction_static": 0.716,
        "max_running_requests": None,
        "max_total_tokens": 16384,
        "chunked_prefill_size": 4096,
        "schedule_policy": "fcfs",
        "page_size": 1,
        "disable_radix_cache": config.prefix_block_size <= 0,
        "tp_size": 1,
        "dp_size": 1,
        "device": "cpu",
        "random_seed": 0,
        "api_key": None,
        "served_model_name": model,
        "weight_version": "default",
        "chat_template": None,
        "enable_cache_report": config.prompt_tokens_details,
        "return_input_ids": False,
        "return_output_ids": False,
        "reasoning_parser": None,
        "tool_call_parser": parser,
        "preferred_sampling_params": None,
        "stream_interval": 1,
        "stream_response_default_include_usage": False,
        "incremental_streaming_output": False,
        "log_level": "info",
        "enable_metrics": False,
        "attention_backend": "torch_native",
        "sampling_backend": "pytorch",
        "grammar_backend": "xgrammar",
        "enable_return_hidden_states": False,
    }


def server_info(config: MockConfig) -> dict[str, Any]:
    """``GET /server_info`` (and ``/get_server_info``)."""
    args = _server_args(config)
    launch = f"--model-path {config.models[0]} --context-length {config.max_model_len}"
    if config.tool_call_parser:
        launch += f" --tool-call-parser {config.tool_call_parser}"
    state = {
        **args,
        "world_size": 1,
        "startup_time": _STARTUP,
        "effective_max_running_requests_per_dp": 4096,
        "last_gen_throughput": 0.0,
        "memory_usage": {"weight": 0.0, "kvcache": 0.008, "token_capacity": 16384},
        "decode_cuda_graph_bs": [],
        "decode_cuda_graph_memory_gb": 0.0,
    }
    hicache: dict[str, Any] = {
        "enabled": False,
        "backend": None,
        "page_size": 1,
        "hicache_object_layout": {"pools": []},
    }
    return {
        **args,
        "launch_command": launch,
        "status": "ready",
        "max_total_num_tokens": 16384,
        "max_req_input_len": config.max_model_len - _RESERVED,
        "startup_time": {**_STARTUP, "tokenizer_e2e": 8.8},
        "hicache_object_layout": hicache | {"reason": "Hierarchical cache is disabled"},
        "kv_events": None,
        "internal_states": [state],
        "version": SGLANG_VERSION,
        "frontend": "python",
    }


def model_card(config: MockConfig, name: str) -> dict[str, Any]:
    """A ``ModelCard``: ``owned_by: sglang``, no permissions."""
    created = int(time.time())
    card = {"id": name, "object": "model", "created": created, "owned_by": "sglang", "root": name, "parent": None}
    return card | {"max_model_len": config.max_model_len}


def models(config: MockConfig) -> dict[str, Any]:
    """``GET /v1/models``: the served models (a real server serves one)."""
    return {"object": "list", "data": [model_card(config, name) for name in config.models]}


def unknown_model(name: str) -> dict[str, Any]:
    """``GET /v1/models/{name}`` of a model the server does not serve (404)."""
    error = {"message": f"The model '{name}' does not exist", "type": "invalid_request_error"}
    return {"error": error | {"param": "model", "code": "model_not_found"}}
