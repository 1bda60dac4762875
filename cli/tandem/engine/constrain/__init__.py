"""Constrained decoding: a grammar (GBNF, a JSON schema, any JSON object) as a token mask,
its forced tokens, and its state along the output (llguidance, imported only when used)."""
