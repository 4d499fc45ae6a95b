"""Rollway's data plane: the OpenAI-compatible ``/v1`` routes that attribute each call to a rollout, route it to a
backend, relay the answer and record the call as a span (``docs/architecture.md`` draws the path of a call)."""
