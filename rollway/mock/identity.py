"""What the mock backend says it is: the vLLM and SGLang releases it imitates, vLLM's ``system_fingerprint`` and the
engines' ids.

vLLM answers ``GET /version`` with ``{"version": VLLM_VERSION}`` and stamps ``vllm-<version>-<hash8>`` (the first
eight hex digits of its configuration's hash) on its answers as ``system_fingerprint``; the mock hashes its own
configuration, so the fingerprint is stable for a given configuration. vLLM's ids are a prefix and 16 hex digits
(a tool call's, ``chatcmpl-tool-<16 hex>``, is drawn from the fake model's seed, so a call repeats with its answer).
SGLang names an answer with 32 hex digits and no prefix (the request's ``rid`` when it gives one), and has no
``system_fingerprint``.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable

VLLM_VERSION = "0.32.0"
SGLANG_VERSION = "0.5.23"


def system_fingerprint(models: Iterable[str], max_model_len: int) -> str:
    digest = hashlib.sha256(repr((tuple(models), max_model_len)).encode("utf-8")).hexdigest()
    return f"vllm-{VLLM_VERSION}-{digest[:8]}"


def random_id() -> str:
    """vLLM's ``random_uuid()``: 16 hex digits."""
    return uuid.uuid4().hex[:16]


def sglang_id() -> str:
    """SGLang's request id: ``uuid.uuid4().hex``."""
    return uuid.uuid4().hex
