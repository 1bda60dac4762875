# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PY := .venv/bin/python
PROMPT ?= Write a Python function that checks whether a number is prime, with a docstring.

.PHONY: demo test test-fast install install-test bench-native bench-peer bench-serve clean

install:
	scripts/bootstrap.sh

install-test:
	scripts/bootstrap.sh --test

# Installs, fetches the default pair (once), then streams a completion with speculative decoding.
demo: install
	.venv/bin/tandem run --stats "$(PROMPT)"

# Installs with test extras, then runs every test (the real-pair ones fetch the pair once).
test: install-test
	$(PY) -m pytest -q

test-fast: install-test
	$(PY) -m pytest -q -m "not slow"

bench-native: install
	$(PY) scripts/bench_native.py --n-max 3 --n-max 8

# tandem against llama-server (built by scripts/build_native.sh), interleaved prompt by prompt.
bench-peer: install
	$(PY) scripts/bench_peer.py --per-category 4 --coding 8 --server plain --tandem default= \
	  --tandem none="--strategy none" --out bench-peer.json

# tandem serve against llama-server (plain, ngram), conversations turn by turn (docs/benchmarks.md 10)
bench-serve: install
	$(PY) scripts/bench_serve.py --build-native --out bench-serve.json

clean:
	rm -rf .venv .pytest_cache
