"""A model's memory type from its GGUF header, before llama.cpp loads it: what `tandem hw` and
`pairs check` say about how drafts will be rolled back (engine/backend/memory.py does it).

The architecture decides, by llama.cpp's own tables (src/llama-arch.cpp of the vendored
source: llm_arch_is_recurrent, llm_arch_is_hybrid, llm_arch_supports_rs_rollback); a
sliding window is a key of the header. A loaded model's type comes from llama.cpp itself
(llama_model_is_hybrid / _is_recurrent, llama_n_rs_seq), which these tables mirror."""
from __future__ import annotations

ATTENTION, SLIDING, HYBRID, RECURRENT = "attention", "sliding window", "hybrid", "recurrent"

RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID_ARCHS = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
    "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
    "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01"})
# the hybrids whose recurrent state llama.cpp snapshots for the last tokens of a batch
# (n_rs_seq): the only ones whose drafts can be rolled back
SNAPSHOT_ARCHS = frozenset({
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h",
    "nemotron_h_moe", "lfm2", "lfm2moe", "bailingmoe3"})

# architectures whose attention layers (some or all) slide over a window: what a catalog
# model is before its header says the window (gemma2/gemma3: every other or five of six layers;
# gemma4: its sliding_window_pattern)
SLIDING_ARCHS = frozenset({"gemma2", "gemma3", "gemma4", "gpt-oss", "cohere2"})

# how each goes back, in the words `tandem hw`, `pairs check` and the docs use
ROLLBACK_WORDS = {
    ATTENTION: "drafts rolled back by truncating the KV cache",
    SLIDING: "drafts rolled back by truncating the KV cache (full-size, as llama.cpp's default)",
    HYBRID: "drafts rolled back from llama.cpp's snapshots of the last batch, elsewhere from "
            "a saved copy of the recurrent state",
    RECURRENT: "no rollback in llama.cpp: decodes plain (no speculation)",
}
NO_SNAPSHOTS = "no snapshots in llama.cpp for this architecture: decodes plain (no speculation)"
# a draft model's own steps are undone whole, from a copy taken before them: any type drafts
AS_DRAFT = "its steps undone from a saved copy of the recurrent state"


def memory_of(architecture: str | None, sliding_window: int = 0) -> str:
    """The memory type of an architecture (llama.cpp's name), given its sliding window."""
    if architecture in HYBRID_ARCHS:
        return HYBRID
    if architecture in RECURRENT_ARCHS:
        return RECURRENT
    return SLIDING if sliding_window > 0 else ATTENTION


def of_catalog(arch: str | None) -> str | None:
    """The memory type of a catalog model from its `arch` (None: the catalog does not say)."""
    if arch is None:
        return None
    return memory_of(arch, 1 if arch in SLIDING_ARCHS else 0)


def describe(header, role: str = "target") -> tuple[str, str]:
    """(memory type, how drafts go back) for a GGUF header (models/gguf_meta.GGUFHeader) of
    the target or the draft."""
    window = header.arch_get("attention.sliding_window", 0)
    kind = memory_of(header.architecture, window if isinstance(window, int) else 0)
    if role == "draft" and kind in (HYBRID, RECURRENT):
        return kind, AS_DRAFT
    if kind == HYBRID and header.architecture not in SNAPSHOT_ARCHS:
        return kind, NO_SNAPSHOTS
    return kind, ROLLBACK_WORDS[kind]
