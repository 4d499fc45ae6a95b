"""Agent-lightning 0.3 compatibility: its store protocol (``/v1/agl/...``) and the OTLP/HTTP trace ingest
(``/v1/traces``) over Rollway's store, so ``agentlightning.LightningStoreClient`` and its runners work against
Rollway unchanged (``docs/agl.md``).

- ``shapes``: Agent-lightning's JSON shapes <-> store schemas (rollouts, attempts, resources, spans; the
  proxy-span view of gateway calls).
- ``listing``: filtering, sorting and offset pagination as Agent-lightning's queries do them.
- ``bodies``: its request bodies; ``queries``: the listings (rollouts, attempts, workers, spans, resources).
- ``routes``: the FastAPI router of ``/v1/agl``.
- ``otlp``: OTLP/HTTP trace decoding (protobuf, gzip, JSON) and ingest.
- ``access``: who may use these routes (admin token as a header or as a ``/t/<token>`` path prefix).
"""
