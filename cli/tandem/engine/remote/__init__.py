"""The target on llama.cpp RPC servers: ggml's device registry, the RPC handshake, and the worker process that holds the pair."""
