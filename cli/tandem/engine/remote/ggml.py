"""ggml's backend registry through ctypes: llama.cpp's RPC devices (attach a server, list the
devices, serve this machine's device to others).

llama-cpp-python binds libllama only, and llama.cpp dropped `rpc_servers` from the model
parameters: its own tools attach a server through ggml's registry (common/arg.cpp,
add_rpc_devices), which lives in libggml, shipped beside libllama in the wheel. This module
opens that same libggml (the one libllama already uses, so the registry is shared) and does
what llama.cpp's tools do. Outside engine/backend's binding modules (llama, model,
mtp) it is the one module that calls llama.cpp's native code (bench/llama_server.py
calls only libc's prctl), and it imports no llama_cpp (tests/test_structure.py holds both).
"""
from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from tandem.build_flags import rebuild_hint
from tandem.errors import ModelError

# enum ggml_backend_dev_type (ggml/include/ggml-backend.h)
DEV_CPU, DEV_GPU, DEV_IGPU, DEV_ACCEL, DEV_META = range(5)


@dataclass(frozen=True)
class Device:
    """One ggml device as llama.cpp sees it: 'CPU', 'CUDA0', 'RPC0' (description: the
    endpoint for an RPC device)."""

    name: str
    description: str
    kind: int
    free: int
    total: int
    backend: str  # the registry it belongs to: CPU, CUDA, RPC...

    @property
    def remote(self) -> bool:
        return self.backend == "RPC"


def lib_dir() -> Path:
    """llama_cpp/lib of the installed wheel, found without importing llama_cpp."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("llama-cpp-python is not installed", rebuild_hint())
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


@lru_cache(maxsize=1)
def _ggml() -> ctypes.CDLL:
    """libggml of the wheel: the file libllama links against (its soname, libggml.so.0), so
    that both share one registry. A wheel keeps no symlinks: libggml.so is a second copy
    with a registry of its own, where attached servers would stay invisible to llama.cpp."""
    names = ("libggml.so.0", "libggml.so", "libggml.dylib", "ggml.dll")
    path = next((lib_dir() / n for n in names if (lib_dir() / n).is_file()), lib_dir() / names[0])
    if not path.is_file():
        raise ModelError(f"the installed llama-cpp-python has no {path.name} in {path.parent}",
                         rebuild_hint(why="a shared-library build"))
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    p, s, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
    for name, res, args in (
            ("ggml_backend_reg_by_name", p, [s]),
            ("ggml_backend_reg_get_proc_address", p, [p, s]),
            ("ggml_backend_register", None, [p]),
            ("ggml_backend_reg_name", s, [p]),
            ("ggml_backend_dev_count", sz, []),
            ("ggml_backend_dev_get", p, [sz]),
            ("ggml_backend_dev_name", s, [p]),
            ("ggml_backend_dev_description", s, [p]),
            ("ggml_backend_dev_type", ctypes.c_int, [p]),
            ("ggml_backend_dev_backend_reg", p, [p]),
            ("ggml_backend_dev_memory", None, [p, ctypes.POINTER(sz), ctypes.POINTER(sz)])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def _rpc_proc(name: str):
    lib = _ggml()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise ModelError("this llama-cpp-python was built without llama.cpp's RPC backend",
                         rebuild_hint(why="-DGGML_RPC=ON is among its flags"))
    addr = lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    if not addr:
        raise ModelError(f"llama.cpp's RPC backend does not export {name}",
                         rebuild_hint())
    return addr


def rpc_supported() -> bool:
    try:
        _rpc_proc("ggml_backend_rpc_add_server")
        return True
    except ModelError:
        return False


_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
# void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir,
#                                    size_t n_threads, size_t n_devices, ggml_backend_dev_t * devices)
_START_SERVER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                 ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))
_attached: dict[str, int] = {}


def attach(endpoints: Sequence[str]) -> None:
    """Register each server's devices, as llama.cpp's --rpc does (common/arg.cpp:
    add_rpc_devices). llama.cpp ABORTS the process when a server cannot be reached or speaks
    another protocol: check each endpoint first (engine/remote/rpc.py) and run this in a worker
    process (engine/remote/worker.py)."""
    add = _ADD_SERVER(_rpc_proc("ggml_backend_rpc_add_server"))
    lib = _ggml()
    for ep in endpoints:
        if ep in _attached:
            continue
        reg = add(ep.encode())
        if not reg:  # a server with no devices
            raise ModelError(f"the rpc-server at {ep} offers no devices", None)
        lib.ggml_backend_register(reg)
        _attached[ep] = reg


def attached() -> tuple[str, ...]:
    """The endpoints attach() registered in this process."""
    return tuple(_attached)


def devices() -> list[Device]:
    """Every registered device, in llama.cpp's order (each RPC device's memory is one round
    trip to its server)."""
    lib = _ggml()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = lib.ggml_backend_dev_backend_reg(dev)
        out.append(Device((lib.ggml_backend_dev_name(dev) or b"").decode(),
                          (lib.ggml_backend_dev_description(dev) or b"").decode(),
                          lib.ggml_backend_dev_type(dev), free.value, total.value,
                          (lib.ggml_backend_reg_name(reg) or b"").decode() if reg else ""))
    return out


def local_offload_devices():
    """A NULL-terminated device array for llama_model_params.devices holding this machine's
    own accelerators only (none on a CPU: every layer then stays on the CPU). Given to the
    draft model, it keeps the draft and its KV cache off the RPC servers, whatever
    n_gpu_layers says; llama.cpp copies the list during the load."""
    lib = _ggml()
    mine = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(dev)
        reg = lib.ggml_backend_dev_backend_reg(dev)
        if kind in (DEV_GPU, DEV_IGPU) and lib.ggml_backend_reg_name(reg) != b"RPC":
            mine.append(dev)
    return (ctypes.c_void_p * (len(mine) + 1))(*mine, None)


_GET_MEMORY = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                               ctypes.POINTER(ctypes.c_size_t))
_IFACE_GET_MEMORY = 2  # ggml_backend_device_i: get_name, get_description, get_memory, ...
_keep: list = []


def _limit_memory(dev: int, limit: int) -> None:
    """Make the device report at most `limit` bytes (free and total) to RPC clients, which
    place layers by it. ggml has no setting for this (rpc-server.cpp has no memory option in
    this llama.cpp), so the device's get_memory entry (ggml-backend-impl.h: struct
    ggml_backend_device starts with its interface, get_memory third) is replaced in this
    process; the server asks it through ggml_backend_dev_memory for each GET_DEVICE_MEMORY."""
    slots = ctypes.cast(ctypes.c_void_p(dev), ctypes.POINTER(ctypes.c_void_p))
    real = ctypes.cast(ctypes.c_void_p(slots[_IFACE_GET_MEMORY]), _GET_MEMORY)

    def get_memory(d, free, total):
        real(d, free, total)
        free[0] = min(free[0], limit)
        total[0] = min(total[0], limit)

    fn = _GET_MEMORY(get_memory)
    _keep.extend([real, fn])
    slots[_IFACE_GET_MEMORY] = ctypes.cast(fn, ctypes.c_void_p).value


def serve(endpoint: str, n_threads: int, cache_dir: str | None = None,
          mem: int | None = None) -> None:
    """llama.cpp's RPC server on this process's libggml (so client and server always speak
    the same protocol), serving the devices its rpc-server picks: the accelerators, else the
    CPU (tools/rpc/rpc-server.cpp, get_devices). Blocks for good; returns only when the
    socket cannot be created (the port in use, a bad address)."""
    start = _START_SERVER(_rpc_proc("ggml_backend_rpc_start_server"))
    lib = _ggml()
    devs, cpu = [], None
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(dev)
        if kind == DEV_CPU and cpu is None:
            cpu = dev
        elif kind not in (DEV_CPU, DEV_ACCEL):
            devs.append(dev)
    if not devs and cpu:
        devs = [cpu]
    if not devs:
        raise ModelError("llama.cpp found no device to serve", None)
    if mem:
        for dev in devs:
            _limit_memory(dev, mem)
    arr = (ctypes.c_void_p * len(devs))(*devs)
    start(endpoint.encode(), cache_dir.encode() if cache_dir else None, max(1, n_threads),
          len(devs), arr)


def served_devices() -> list[Device]:
    """What serve() would offer (for the server's banner)."""
    all_ = devices()
    accel = [d for d in all_ if d.kind not in (DEV_CPU, DEV_ACCEL)]
    return accel or [d for d in all_ if d.kind == DEV_CPU][:1]


def exit_on_abort() -> None:
    """In a worker process: make abort() (GGML_ABORT on a broken RPC connection) end the
    process at once with _exit(SIGABRT) instead of dumping core. _exit has exactly a signal
    handler's signature, so libc's own function is the handler: no Python code runs in the
    signal context."""
    import signal

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(int(signal.SIGABRT), ctypes.cast(libc._exit, ctypes.c_void_p))
