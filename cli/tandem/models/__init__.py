"""Model files: catalog, references, store and its sources, GGUF headers, vocabularies."""
