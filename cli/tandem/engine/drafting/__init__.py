"""Draft sources: the Drafter protocol and its drafters, strategies by name, auto's sources and lengths, the n-gram and suffix indexes, and the history of earlier answers they draw on."""
