"""The parts ``Store`` is assembled from: its public methods by area, one mixin per module (``queue``,
``lifecycle``, ``spans``, ``catalog``, ``agents``, ``edits``, ``reads``, ``wal``), each method one read or one
write operation (a function of ``store.sql``) run through the paths ``plumbing`` declares and ``store.store``
provides; and ``keepalive``, this process's record of its LLM calls in flight, whose loop keeps their attempts
alive."""
