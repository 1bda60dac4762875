"""Interactive chat: the session (history, KV reuse) and its Rich terminal UI."""
