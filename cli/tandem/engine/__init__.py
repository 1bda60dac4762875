"""The speculative decoding engine: llama.cpp wrapper, sampling, drafters, the generate loop."""
