"""The llama.cpp backend: the binding modules (llama.py, model.py, mtp.py) are the only ones importing llama_cpp; the context parameters, model loading and chat templates beside them."""
