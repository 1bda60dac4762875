"""The decode loop: generate() (speculative.py), its events and statistics, sampling, and the text stream."""
