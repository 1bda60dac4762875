"""What the engine measures and chooses: cost models (costs, pricing), what paid before (knowledge), and the thread count (threads)."""
