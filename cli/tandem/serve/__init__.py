"""`tandem serve`: the OpenAI-compatible API (app: routes; protocol: the wire format; scheduler: the slots that run the pair)."""
