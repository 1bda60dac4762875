"""`tandem serve`: the OpenAI-compatible API (app: routes; protocol: the wire format; engine_thread: the one thread that runs the pair)."""
