"""What scoring the logprobs an engine left out costs per call, against a real vLLM (the CPU build and the
tests' tiny random-weight model: ``bash .ci/vllm-venv`` builds the environment).

Three ways, in the same run, each ``--calls`` sequential calls (one agent's turns), medians reported:

- ``direct``: a streamed Responses API call sent to vLLM itself (the floor: no proxy);
- ``rollway, scoring off``: the same call through ``rollway serve`` with ``ROLLWAY_SCORE_MISSING_LOGPROBS=false``
  (its span has token ids, and no logprob for the end token the stream leaves out);
- ``rollway, scoring on`` (the default): the same call, whose span gets every logprob from one more engine
  request (``gateway.scoring``).

The difference between the last two is scoring's cost per call, here a prefill of the prompt and the output on
two CPU cores; on a GPU the prefill is a small share of a generation's time.

    .venv/bin/python bench/scoring_bench.py --calls 30
    .venv/bin/python bench/scoring_bench.py --calls 20 --prompt-words 600   # a long prompt (about 1,200 tokens)

``--prompt-words N`` makes the prompt ``"hello world"`` N times over: scoring prefills the prompt again (vLLM
computes prompt logprobs without its prefix cache), so its cost grows with the prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from rollway.admin.client import AsyncRollwayClient  # noqa: E402
from rollway.process import GatewayProcess  # noqa: E402
from support.vllm_env import CHAT_ARGS, CHAT_MODEL, START_TIMEOUT, _start, _wait_healthy, tiny_model  # noqa: E402

ASK: dict[str, Any] = {"input": "hello world", "max_output_tokens": 32, "temperature": 1.0, "stream": True}


def ask(prompt_words: int) -> dict[str, Any]:
    return ASK | {"input": " ".join(["hello world"] * prompt_words)}


async def timed_calls(client: AsyncOpenAI, model: str, calls: int, prompt_words: int = 1) -> list[float]:
    seconds = []
    for n in range(calls):
        began = time.perf_counter()
        async for _ in await client.responses.create(model=model, extra_body={"seed": n}, **ask(prompt_words)):
            pass
        seconds.append(time.perf_counter() - began)
    return seconds


async def through_rollway(
    engine_url: str, calls: int, scoring: bool, folder: Path, prompt_words: int
) -> tuple[list[float], str]:
    env = {"ROLLWAY_SCORE_MISSING_LOGPROBS": "true" if scoring else "false"}
    with GatewayProcess(f"sqlite:///{folder / f'scoring-{scoring}.db'}", env=env) as gateway:
        async with AsyncRollwayClient(gateway.url) as admin:
            backend = {"base_url": f"{engine_url}/v1", "kind": "vllm", "model": CHAT_MODEL}
            await admin.put_model("policy", [backend])
            await admin.enqueue([{"input": {"n": 0}}])
            [claim] = await admin.claim(limit=1)
            async with AsyncOpenAI(base_url=claim.base_url, api_key=claim.api_key, max_retries=0) as client:
                await timed_calls(client, "policy", 2, prompt_words)  # warm-up
                seconds = await timed_calls(client, "policy", calls, prompt_words)
            spans = await admin.get_spans(claim.rollout.rollout_id)
    sources = {str(span.attributes.get("rollway.logprobs_source")) for span in spans}
    return seconds, ",".join(sorted(sources))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--prompt-words", type=int, default=1, help='the prompt: "hello world" this many times')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        engine = _start("chat", tiny_model(), CHAT_ARGS, folder / "vllm.log")
        try:
            await asyncio.to_thread(_wait_healthy, [engine], START_TIMEOUT)
            async with AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0) as direct:
                await timed_calls(direct, CHAT_MODEL, 2, args.prompt_words)
                floor = await timed_calls(direct, CHAT_MODEL, args.calls, args.prompt_words)
            off, off_sources = await through_rollway(engine.url, args.calls, False, folder, args.prompt_words)
            on, on_sources = await through_rollway(engine.url, args.calls, True, folder, args.prompt_words)
        finally:
            engine.stop()
    rows = [
        ("direct (floor)", floor, "-"),
        ("rollway, scoring off", off, off_sources),
        ("rollway, scoring on", on, on_sources),
    ]
    print(f"{'':24} {'median ms':>10} {'p90 ms':>8}  logprobs_source")
    for name, seconds, sources in rows:
        p90 = statistics.quantiles(seconds, n=10)[-1]
        print(f"{name:24} {statistics.median(seconds) * 1e3:10.1f} {p90 * 1e3:8.1f}  {sources}")
    on_ms, off_ms, floor_ms = (statistics.median(x) * 1e3 for x in (on, off, floor))
    print(f"scoring's cost per call (median on - median off): {on_ms - off_ms:.1f} ms")
    print(f"on/off {on_ms / off_ms:.2f}x, on/direct {on_ms / floor_ms:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
