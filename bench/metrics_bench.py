"""What metrics cost one call on the hot path, in microseconds (``timeit`` of the recording functions).

Per call the gateway runs ``Metrics.call_started`` (in-flight gauge +1), ``Metrics.observe_call`` (request
counter, latency histogram, tokens; TTFT for streamed calls) and the in-flight gauge -1, plus the request id
(``logs.request_id`` over the request headers, and setting/resetting its context variable). Measured here on
warm label caches, as in a running server; the cold first call of a label set costs more, once.

    python bench/metrics_bench.py [--number 200000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from collections.abc import Callable

from rollway import logs
from rollway.gateway.metrics import Metrics
from rollway.gateway.record import CallRecord
from rollway.store import Backend

HEADERS = [
    (b"host", b"127.0.0.1:8080"),
    (b"accept", b"application/json"),
    (b"accept-encoding", b"gzip, deflate"),
    (b"connection", b"keep-alive"),
    (b"content-type", b"application/json"),
    (b"user-agent", b"OpenAI/Python 1.99.0"),
    (b"authorization", b"Bearer rk-0123456789abcdef"),
    (b"content-length", b"123"),
]


def record(stream: bool) -> CallRecord:
    now = time.time()
    backend = Backend(backend_id="mock-a", base_url="http://127.0.0.1:8001/v1", kind="vllm", model="m")
    rec = CallRecord(operation="chat", alias="policy", request={}, stream=stream, start_time=now - 0.05)
    rec.backend = backend
    rec.status_code = 200
    rec.end_time = now
    rec.ttft_seconds = 0.01
    rec.response = {"usage": {"prompt_tokens": 42, "completion_tokens": 16, "total_tokens": 58}}
    return rec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    metrics = Metrics(multiprocess_dir="")
    whole, streamed = record(False), record(True)

    def call(rec: CallRecord) -> None:
        gauge = metrics.count_in_flight("policy")
        metrics.observe_call(rec, True)
        gauge.dec()

    def request_id() -> None:
        token = logs.REQUEST_ID.set(logs.request_id(HEADERS))
        logs.REQUEST_ID.reset(token)

    cases: dict[str, Callable[[], object]] = {
        "call, not streamed (in-flight ±1, counter, histogram, tokens)": lambda: call(whole),
        "call, streamed (same + TTFT histogram)": lambda: call(streamed),
        "request id (header scan, new id, context variable)": request_id,
        "empty lambda (timeit's own overhead, not subtracted above)": lambda: None,
    }
    for name, fn in cases.items():
        fn()  # warm the label caches
        runs = timeit.repeat(fn, number=args.number, repeat=args.repeat)
        per_call = [r / args.number * 1e6 for r in runs]
        print(f"{statistics.median(per_call):6.2f} µs  (min {min(per_call):.2f})  {name}")


if __name__ == "__main__":
    main()
