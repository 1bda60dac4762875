"""`tandem serve`: the OpenAI-compatible API (app: routes; protocol: the wire format; worker: the engine thread)."""
