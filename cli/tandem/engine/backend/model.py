"""A loaded GGUF model through llama.cpp (Model: its weights, vocabulary, metadata and chat
template), and llama.cpp's process-wide set-up that loading needs first: the backend
initialised once, its log, what this build can offload to.

A binding module (tests/test_structure.py names them): llama.py, whose contexts run a
Model, imports it first and re-exports what it defines, so that callers keep one place to
import the backend from.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Callable, Sequence

from tandem.build_flags import rebuild_hint
from tandem.engine.backend.fim import FimTokens
from tandem.engine.backend.memory import memory_type
from tandem.errors import ModelError

try:
    import llama_cpp as _lc
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ModelError(
        f"llama-cpp-python is not installed ({exc})",
        rebuild_hint(),
    ) from exc

LLAMA_CPP_VERSION = getattr(_lc, "__version__", "unknown")
# the attributes of the tokens llama_tokenize parses from text (llama-vocab.cpp's special cache)
_SPECIAL_ATTRS = (_lc.LLAMA_TOKEN_ATTR_CONTROL | _lc.LLAMA_TOKEN_ATTR_USER_DEFINED
                  | _lc.LLAMA_TOKEN_ATTR_UNKNOWN)
# the ones it parses only with parse_special: user-defined tokens ("<tool_call>") it makes
# from plain text too, so a grammar must be able to write them as text
_CONTROL_ATTRS = _lc.LLAMA_TOKEN_ATTR_CONTROL | _lc.LLAMA_TOKEN_ATTR_UNKNOWN

_backend_ready = False
_verbose = False
_captured: list[str] | None = None


@_lc.llama_log_callback
def _log_sink(level, text, user_data):  # noqa: ARG001 - ctypes signature
    if _verbose:
        os.write(2, text)
    if _captured is not None:
        _captured.append(text.decode("utf-8", "replace"))


def capture_log(on: bool = True) -> list[str]:
    """Opt-in: keep llama.cpp's log (where it put each layer, buffer sizes) from now on.
    Returns the list that collects it; off, what was collected."""
    global _captured
    init_backend(_verbose)
    got = _captured if _captured is not None else []
    _captured = [] if on else None
    return _captured if on else got


def init_backend(verbose: bool = False) -> None:
    """Initialise llama.cpp once; its log goes to stderr only when verbose."""
    global _backend_ready, _verbose
    _verbose = verbose
    if not _backend_ready:
        _lc.llama_log_set(_log_sink, ctypes.c_void_p(0))
        _lc.llama_backend_init()
        _backend_ready = True


def supports_gpu_offload() -> bool:
    """Whether this machine has an accelerator llama.cpp can offload to. Not
    llama_supports_gpu_offload(): it also says yes for any build with the RPC backend,
    which would take a CPU-only machine (or a target on a CPU rpc-server) for a GPU."""
    from tandem.engine.remote.ggml import local_offload_devices

    return bool(_lc.llama_supports_gpu_offload()) and len(local_offload_devices()) > 1


def _rpc_attached() -> bool:
    from tandem.engine.remote.ggml import attached

    return bool(attached())


def system_info() -> str:
    return _lc.llama_print_system_info().decode("utf-8", "replace")


# the architectures whose graph runs an MTP head (src/models/*.cpp that build
# LLM_GRAPH_TYPE_DECODER_MTP); others with nextn layers (glm4's dense models) keep them unused,
# and an MTP context of theirs would run the trunk's graph on the head's inputs (an abort)
MTP_ARCHS = frozenset({"bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4",
                       "glm-dsa", "glm4moe", "glm5-next", "hy_v3", "mimo2", "nemotron_h_moe",
                       "qwen35", "qwen35moe", "qwen3next", "step35"})


# llama_model_params.load_mode by (mmap, mlock), as llama-cpp-python's Llama maps its
# use_mmap and use_mlock (0.3.36 has no separate fields for them)
LOAD_MODES = {(True, False): _lc.LLAMA_LOAD_MODE_MMAP, (False, False): _lc.LLAMA_LOAD_MODE_NONE,
              (True, True): _lc.LLAMA_LOAD_MODE_MMAP_MLOCK,
              (False, True): _lc.LLAMA_LOAD_MODE_MLOCK}



class Model:
    """A loaded GGUF model and its vocabulary."""

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0, use_mmap: bool = True,
                 verbose: bool = False, repack: bool = False, local_only: bool = False,
                 progress: Callable[[float], None] | None = None, load_mtp: bool = False,
                 use_mlock: bool = False):
        """`use_mmap`: map the weights from the file (else read them into memory);
        `use_mlock`: lock them in RAM (llama.cpp only warns where that is not permitted);
        `local_only`: this machine's devices only, never an attached RPC server (the
        draft next to a remote target); `progress`: called during the load (a worker's
        heartbeat while weights go over the link); `load_mtp`: also load the model's
        multi-token-prediction heads (nextn layers), which an MTP draft runs (MtpHead)."""
        init_backend(verbose)
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"model file not found: {self.path}",
                             "run `tandem pull` or check the path")
        params = _lc.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        gpu = supports_gpu_offload()
        self.on_gpu = n_gpu_layers != 0 and gpu
        params.load_mode = LOAD_MODES[use_mmap, use_mlock]
        # Repacked CPU weights switch to a different GEMM kernel for batches of 4+ tokens, so
        # verify-batch logits would differ from single-token decoding; without repacking (and
        # with flash attention, q8_0 KV) the CPU backend gives bit-identical rows for batches
        # of up to EXACT_BATCH tokens.
        params.use_extra_bufts = repack
        params.load_mtp = load_mtp
        keep = None
        if local_only:
            from tandem.engine.remote.ggml import local_offload_devices

            keep = local_offload_devices()  # llama.cpp copies the list during the load
            params.devices = ctypes.addressof(keep)
        if progress is not None:
            def report(value, user_data):  # noqa: ARG001 - ctypes signature
                progress(value)
                return True
            keep = (keep, _lc.llama_progress_callback(report))
            params.progress_callback = keep[1]
        ptr = _lc.llama_model_load_from_file(str(self.path).encode(), params)
        del keep
        if not ptr:
            raise ModelError(f"llama.cpp could not load {self.path.name}",
                             "the file may be truncated or of an unsupported architecture; "
                             "run with --verbose to see llama.cpp's reason")
        self._ptr = ptr
        self.vocab = _lc.llama_model_get_vocab(ptr)
        self.n_vocab = _lc.llama_vocab_n_tokens(self.vocab)
        self.n_layer = _lc.llama_model_n_layer(ptr)
        # MTP heads: how many the file has, and whether they were loaded (an MTP context on a
        # model loaded without them would run a graph whose weights are missing)
        self.n_layer_nextn = _lc.llama_model_n_layer_nextn(ptr)
        self.arch = self.meta("general.architecture") or "unknown"
        self.mtp_loaded = load_mtp and self.n_layer_nextn > 0 and self.arch in MTP_ARCHS
        # every layer and the output on the GPU (llama.cpp offloads the output layer only when
        # n_gpu_layers exceeds n_layer); a partial offload still runs CPU kernels
        self.fully_on_gpu = gpu and (n_gpu_layers < 0 or n_gpu_layers > self.n_layer)
        # layers on RPC servers run kernels tandem has not measured (a CPU server's are the
        # unrepacked CPU ones): exact mode keeps its batch cap for them
        self.remote = not local_only and n_gpu_layers != 0 and _rpc_attached()
        if self.remote:
            self.fully_on_gpu = False
        self.n_ctx_train = _lc.llama_model_n_ctx_train(ptr)
        # how a context of this model goes back (engine/backend/memory.py)
        self.n_swa = _lc.llama_model_n_swa(ptr)
        self.memory = memory_type(bool(_lc.llama_model_is_hybrid(ptr)),
                                  bool(_lc.llama_model_is_recurrent(ptr)), self.n_swa)
        self.bos = _lc.llama_vocab_bos(self.vocab)
        self.eos = _lc.llama_vocab_eos(self.vocab)
        self.add_bos = bool(_lc.llama_vocab_get_add_bos(self.vocab))
        self._pieces: dict[int, bytes] = {}
        self._eog = frozenset(tok for tok in range(self.n_vocab)
                              if _lc.llama_vocab_is_eog(self.vocab, tok))

    def close(self) -> None:
        if getattr(self, "_ptr", None):
            _lc.llama_model_free(self._ptr)
            self._ptr = None

    def __del__(self):
        self.close()

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (_lc.llama_token * cap)()
        n = _lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (_lc.llama_token * cap)()
            n = _lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (control tokens render as nothing)."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = _lc.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = _lc.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
            cached = buf.raw[:n]
            self._pieces[token] = cached
        return cached

    def is_special(self, token: int) -> bool:
        """A token llama.cpp's parser matches by its text (control, user-defined, unknown)."""
        return bool(_lc.llama_vocab_get_attr(self.vocab, token) & _SPECIAL_ATTRS)

    def vocab_bytes(self) -> tuple[list[bytes], list[bool]]:
        """Every token's bytes with control tokens rendered as their text, and which are
        control tokens (never made from text without parse_special): what a grammar library
        builds its token trie from. User-defined tokens such as Qwen's "<tool_call>" are not:
        llama_tokenize makes them from plain text, so a grammar's forced text may hold them."""
        buf = ctypes.create_string_buffer(256)
        out, special = [], []
        for token in range(self.n_vocab):
            out.append(self._rendered(token, buf))
            special.append(bool(_lc.llama_vocab_get_attr(self.vocab, token) & _CONTROL_ATTRS))
        return out, special

    def fim_tokens(self) -> FimTokens:
        """The vocabulary's fill-in-the-middle tokens, as llama.cpp found them (GGUF keys, or
        known token texts such as Qwen's "<|fim_prefix|>")."""
        v = self.vocab
        return FimTokens(pre=_lc.llama_vocab_fim_pre(v), suf=_lc.llama_vocab_fim_suf(v),
                         mid=_lc.llama_vocab_fim_mid(v), rep=_lc.llama_vocab_fim_rep(v),
                         sep=_lc.llama_vocab_fim_sep(v), pad=_lc.llama_vocab_fim_pad(v))

    def rendered_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """Each token's bytes, control tokens as their text (llama-server's /detokenize)."""
        buf = ctypes.create_string_buffer(256)
        return [self._rendered(t, buf) for t in tokens]

    def _rendered(self, token: int, buf) -> bytes:
        """A token's bytes with a control token as its text; `buf`: a 256-byte scratch."""
        n = _lc.llama_token_to_piece(self.vocab, token, buf, 256, 0, True)
        if n >= 0:
            return buf.raw[:n]
        big = ctypes.create_string_buffer(-n)
        n = _lc.llama_token_to_piece(self.vocab, token, big, -n, 0, True)
        return big.raw[:n]

    def eog_tokens(self) -> list[int]:
        return sorted(self._eog)

    def tokenizer_entry(self) -> tuple[int, int]:
        """(vocab pointer, llama_tokenize's address): for a native library that tokenizes
        forced text with llama.cpp's own tokenizer, never through Python."""
        fptr = ctypes.cast(_lc.llama_tokenize, ctypes.c_void_p).value
        return int(ctypes.cast(self.vocab, ctypes.c_void_p).value), int(fptr)

    def token_text(self, token: int) -> str:
        return _lc.llama_vocab_get_text(self.vocab, token).decode("utf-8", "replace")

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = _lc.llama_model_meta_val_str(self._ptr, key.encode(), buf, 4096)
        if n < 0:
            return None
        if n >= 4096:
            buf = ctypes.create_string_buffer(n + 1)
            _lc.llama_model_meta_val_str(self._ptr, key.encode(), buf, n + 1)
        return buf.value.decode("utf-8", "replace")

    def chat_template(self) -> str | None:
        raw = _lc.llama_model_chat_template(self._ptr, None)
        return raw.decode("utf-8", "replace") if raw else None

    def apply_builtin_template(self, template: str, messages: Sequence[dict]) -> str | None:
        """llama.cpp's built-in (non-Jinja) rendering of a known template; None if unknown."""
        arr = (_lc.llama_chat_message * len(messages))()
        keep = []
        for i, msg in enumerate(messages):
            role, content = msg["role"].encode(), msg["content"].encode()
            keep += [role, content]
            arr[i].role, arr[i].content = role, content
        cap = 256 + sum(len(m["content"].encode()) for m in messages) * 2
        buf = ctypes.create_string_buffer(cap)
        n = _lc.llama_chat_apply_template(template.encode(), arr, len(messages), True, buf, cap)
        if n < 0:
            return None
        if n > cap:
            buf = ctypes.create_string_buffer(n)
            _lc.llama_chat_apply_template(template.encode(), arr, len(messages), True, buf, n)
        return buf.raw[:n].decode("utf-8", "replace")
