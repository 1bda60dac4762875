"""The llama.cpp backend: llama.py is the only module importing llama_cpp; the context parameters, model loading and chat templates beside it."""
