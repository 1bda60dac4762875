"""The speculative decoding engine, by job: loop/ (generate(), the one loop), drafting/ (draft
sources), tuning/ (cost models, what paid, threads), backend/ (llama.cpp), remote/ (the target
on RPC servers); pair.py composes them into a PairSession."""
