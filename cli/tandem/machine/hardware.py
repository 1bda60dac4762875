"""Facts about this machine: OS, CPU, RAM, GPUs, and what the installed llama.cpp can use.

Facts only; choosing settings is profiles.py's and planner.py's job. Detection is split in two so
tests can replay recorded outputs: `probe()` runs the commands and reads the files, keeping
their raw text in a `RawProbe`; `from_probe()` parses that text and never touches the system.
Nothing here prints; notes and warnings travel inside the returned `Hardware`.

Over 400 lines because it holds one parser per source (nvidia-smi, /proc/cpuinfo,
/proc/meminfo, sysctl, llama.cpp's system info) beside the probe that collects them: split,
each would be a handful of lines with the same imports.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from tandem.build_flags import rebuild_hint

GiB = 1 << 30
MiB = 1 << 20

NVIDIA_SMI_QUERY = [
    "nvidia-smi",
    "--query-gpu=name,memory.total,memory.free",
    "--format=csv,noheader,nounits",
]
# Only the keys we read: `sysctl -a` is slow and large.
SYSCTL_KEYS = [
    "hw.memsize",
    "hw.physicalcpu",
    "hw.logicalcpu",
    "hw.perflevel0.physicalcpu",
    "hw.perflevel1.physicalcpu",
    "machdep.cpu.brand_string",
    "hw.optional.neon",
    "hw.optional.arm.FEAT_DotProd",
    "hw.optional.arm.FEAT_I8MM",
    "hw.optional.arm.FEAT_BF16",
    "iogpu.wired_limit_mb",
    "kern.osproductversion",
]
# sysctl flag -> the name ggml uses for the same CPU feature
_SYSCTL_FLAGS = {
    "hw.optional.neon": "neon",
    "hw.optional.arm.FEAT_DotProd": "dotprod",
    "hw.optional.arm.FEAT_I8MM": "i8mm",
    "hw.optional.arm.FEAT_BF16": "bf16",
}
# Without iogpu.wired_limit_mb, macOS lets Metal wire about 2/3 of RAM on small machines and
# about 3/4 from 64 GB up (docs/hardware.md: 65-78%); llama.cpp's Metal backend reports the same
# limit (recommendedMaxWorkingSetSize) as the GPU's free memory.
APPLE_GPU_SHARE_SMALL = 0.67
APPLE_GPU_SHARE_LARGE = 0.75
APPLE_LARGE_RAM = 64 * GiB



@dataclass(frozen=True)
class CPUInfo:
    model: str
    arch: str  # platform.machine(): x86_64, arm64, aarch64
    physical_cores: int
    logical_cores: int
    flags: frozenset[str] = frozenset()

    @property
    def simd(self) -> list[str]:
        """The SIMD extensions llama.cpp's CPU kernels care about, in a readable order."""
        wanted = ["avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16",
                  "avx_vnni", "amx_tile", "neon", "dotprod", "i8mm", "bf16"]
        return [f for f in wanted if f in self.flags]


@dataclass(frozen=True)
class GPUInfo:
    vendor: str  # "nvidia" | "apple"
    name: str
    memory_total: int  # bytes
    memory_free: int | None  # bytes the GPU can still use now (Apple: the Metal limit)
    index: int = 0
    unified: bool = False  # shares system RAM (Apple Silicon)


@dataclass(frozen=True)
class BackendInfo:
    """What the installed llama-cpp-python binding was built with."""

    llama_cpp_version: str
    gpu_offload: bool | None  # None: the binding could not be loaded
    system_info: str = ""
    error: str | None = None

    @property
    def name(self) -> str:
        info = self.system_info
        if self.gpu_offload is None:
            return "unknown"
        if not self.gpu_offload:
            return "cpu"
        if "CUDA" in info:
            return "cuda"
        if "Metal" in info or "MTL" in info:
            return "metal"
        if "Vulkan" in info:
            return "vulkan"
        return "gpu"

    @property
    def repack(self) -> bool:
        """CPU weights are repacked into interleaved layouts (an extra CPU_REPACK buffer)."""
        return "REPACK = 1" in self.system_info


@dataclass(frozen=True)
class Hardware:
    os: str  # "linux" | "darwin" | "windows" | ...
    os_release: str
    cpu: CPUInfo
    ram_total: int
    ram_available: int | None
    gpus: tuple[GPUInfo, ...] = ()
    apple_chip: str | None = None  # "Apple M2 Ultra"
    backend: BackendInfo | None = None
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def ggml_cpu_features(self) -> frozenset[str]:
        """CPU features llama.cpp's kernels were built for (lower-case ggml names: avx2, avx512,
        neon, dotprod, matmul_int8). From the binding when known: what it was compiled with
        decides its kernels, not what the CPU could do. Otherwise from the CPU's own flags."""
        if self.backend is not None and self.backend.system_info:
            cpu = parse_system_info(self.backend.system_info).get("CPU", {})
            if cpu:
                return frozenset(k.lower() for k, v in cpu.items() if v == "1")
        flags = self.cpu.flags
        mapped = {"avx2": "avx2", "avx512f": "avx512", "neon": "neon", "dotprod": "dotprod",
                  "i8mm": "matmul_int8", "fma": "fma", "f16c": "f16c"}
        return frozenset(v for k, v in mapped.items() if k in flags)

    @property
    def vendor(self) -> str:
        """Which accelerator family this machine has: nvidia, apple or cpu."""
        if any(g.vendor == "nvidia" for g in self.gpus):
            return "nvidia"
        if self.apple_chip:
            return "apple"
        return "cpu"

    @property
    def nvidia_gpus(self) -> tuple[GPUInfo, ...]:
        return tuple(g for g in self.gpus if g.vendor == "nvidia")

    @property
    def accelerator_memory(self) -> int:
        """Memory a profile is sized by: VRAM (all NVIDIA GPUs), unified memory, or RAM."""
        if self.vendor == "nvidia":
            return sum(g.memory_total for g in self.nvidia_gpus)
        return self.ram_total

    @property
    def gpu_free(self) -> int | None:
        """Bytes the GPU(s) can take now; None without a usable GPU."""
        gpus = self.nvidia_gpus if self.vendor == "nvidia" else self.gpus
        if not gpus:
            return None
        return sum(g.memory_free if g.memory_free is not None else g.memory_total for g in gpus)

    @property
    def device_name(self) -> str:
        if self.vendor == "nvidia":
            names = [g.name for g in self.nvidia_gpus]
            if len(names) == 1:
                return names[0]
            return f"{len(names)}x {names[0]}" if len(set(names)) == 1 else " + ".join(names)
        if self.apple_chip:
            return self.apple_chip
        return self.cpu.model

    @property
    def device_id(self) -> str:
        """A stable slug of the main compute device, for keying measured/tuned results."""
        base = self.device_name if self.vendor != "cpu" else f"cpu {self.cpu.model}"
        return re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-") or "unknown"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu"].pop("flags")  # hundreds of names; the ones that matter follow
        d["cpu"]["simd"] = self.cpu.simd
        d["ggml_cpu_features"] = sorted(self.ggml_cpu_features)
        d["vendor"] = self.vendor
        d["device_id"] = self.device_id
        if self.backend is not None:
            d["backend"]["name"] = self.backend.name
            d["backend"].pop("system_info", None)
        return d


@dataclass(frozen=True)
class RawProbe:
    """Everything detection read from the system, as text, so it can be recorded and replayed."""

    system: str  # platform.system(): "Linux", "Darwin", "Windows"
    machine: str  # platform.machine()
    release: str = ""
    cpuinfo: str | None = None  # /proc/cpuinfo
    meminfo: str | None = None  # /proc/meminfo
    sysctl: str | None = None  # `sysctl <SYSCTL_KEYS>` output (macOS)
    nvidia_smi: str | None = None  # stdout of NVIDIA_SMI_QUERY when it succeeded
    nvidia_smi_error: str | None = None  # why there is no nvidia-smi output
    cpu_count: int | None = None  # os.cpu_count(), the last resort
    backend: BackendInfo | None = None


# ----------------------------------------------------------------------------- parsers


class HardwareParseError(ValueError):
    pass


def parse_nvidia_smi(text: str) -> list[GPUInfo]:
    """Parse `nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv,noheader,nounits`.

    Memory is in MiB. "[N/A]" (some laptop and MIG setups) leaves the free memory unknown.
    Raises HardwareParseError when a line does not look like that output (driver errors).
    """
    gpus: list[GPUInfo] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        parts = [p.strip() for p in line.rsplit(",", 2)]
        if len(parts) != 3:
            raise HardwareParseError(f"unexpected nvidia-smi line: {line[:120]!r}")
        name, total, free = parts
        try:
            total_mib = float(total)
        except ValueError:
            raise HardwareParseError(f"unexpected nvidia-smi line: {line[:120]!r}") from None
        try:
            free_bytes: int | None = int(float(free) * MiB)
        except ValueError:
            free_bytes = None
        gpus.append(GPUInfo("nvidia", name, int(total_mib * MiB), free_bytes, index=len(gpus)))
    return gpus


def parse_cpuinfo(text: str, machine: str = "") -> CPUInfo:
    """Model, flags and core counts from Linux /proc/cpuinfo (x86 and ARM layouts)."""
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    model = ""
    flags: set[str] = set()
    logical = 0
    cores: set[tuple[str, str]] = set()
    cores_per_socket: dict[str, int] = {}
    arm_parts: set[str] = set()
    for block in blocks:
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if ":" in line:
                k, _, v = line.partition(":")
                fields[k.strip().lower()] = v.strip()
        if "processor" in fields and fields["processor"].isdigit():
            logical += 1
        model = model or fields.get("model name", "") or fields.get("hardware", "")
        if "flags" in fields:
            flags |= set(fields["flags"].split())
        if "features" in fields:  # ARM: map kernel names to the ones ggml reports
            feats = set(fields["features"].split())
            flags |= feats
            if feats & {"asimd", "neon"}:
                flags.add("neon")
            if "asimddp" in feats:
                flags.add("dotprod")
        if "cpu part" in fields:
            arm_parts.add(fields["cpu part"])
        if "physical id" in fields and "core id" in fields:
            cores.add((fields["physical id"], fields["core id"]))
        if "physical id" in fields and fields.get("cpu cores", "").isdigit():
            cores_per_socket[fields["physical id"]] = int(fields["cpu cores"])
    if not model and arm_parts:
        model = f"ARM CPU (part {', '.join(sorted(arm_parts))})"
    physical = len(cores) or sum(cores_per_socket.values()) or logical
    return CPUInfo(model=model or "unknown CPU", arch=machine, physical_cores=max(physical, 1),
                   logical_cores=max(logical, physical, 1), flags=frozenset(flags))


def parse_meminfo(text: str) -> tuple[int, int | None]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+):\s+(\d+)\s*kB", line)
        if m:
            values[m.group(1)] = int(m.group(2)) * 1024
    if "MemTotal" not in values:
        raise HardwareParseError("no MemTotal line in /proc/meminfo")
    return values["MemTotal"], values.get("MemAvailable")


def parse_sysctl(text: str) -> dict[str, str]:
    """`sysctl a b c` output ("key: value", or "key = value" on old systems) as a dict."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^([\w.]+)\s*[:=]\s*(.*)$", line.strip())
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def apple_gpu_limit(ram_total: int, wired_limit_mb: int = 0) -> int:
    """Bytes Metal may use on Apple Silicon: iogpu.wired_limit_mb if set, else macOS's share."""
    if wired_limit_mb > 0:
        return min(wired_limit_mb * MiB, ram_total)
    share = APPLE_GPU_SHARE_LARGE if ram_total >= APPLE_LARGE_RAM else APPLE_GPU_SHARE_SMALL
    return int(ram_total * share)


def parse_system_info(text: str) -> dict[str, dict[str, str]]:
    """llama_print_system_info(): "CPU : AVX = 1 | ... CUDA : ARCHS = 890 | ..." by backend."""
    out: dict[str, dict[str, str]] = {}
    current = None
    for part in text.split("|"):
        part = part.strip()
        if not part:
            continue
        m = re.match(r"^(\w[\w-]*)\s*:\s*(.*)$", part)
        if m and "=" in m.group(2):
            current = m.group(1)
            out.setdefault(current, {})
            part = m.group(2)
        if current and "=" in part:
            k, _, v = part.partition("=")
            out[current][k.strip()] = v.strip()
    return out


# ------------------------------------------------------------------------------ assembly


def from_probe(raw: RawProbe) -> Hardware:
    """Turn recorded probe text into Hardware; pure, so tests replay fixture files."""
    system = raw.system.lower()
    notes: list[str] = []
    warnings: list[str] = []
    sysctl = parse_sysctl(raw.sysctl) if raw.sysctl else {}
    apple_chip = None

    if system == "darwin" and sysctl:
        brand = sysctl.get("machdep.cpu.brand_string", "")
        flags = {name for key, name in _SYSCTL_FLAGS.items() if sysctl.get(key) == "1"}
        physical = _int(sysctl.get("hw.physicalcpu")) or raw.cpu_count or 1
        cpu = CPUInfo(model=brand or "unknown CPU", arch=raw.machine,
                      physical_cores=_int(sysctl.get("hw.perflevel0.physicalcpu")) or physical,
                      logical_cores=_int(sysctl.get("hw.logicalcpu")) or physical,
                      flags=frozenset(flags))
        ram_total = _int(sysctl.get("hw.memsize")) or 0
        ram_available = None  # macOS has no MemAvailable; the planner keeps a margin instead
        if brand.startswith("Apple") or raw.machine == "arm64":
            apple_chip = brand or "Apple Silicon"
    else:
        cpu = (parse_cpuinfo(raw.cpuinfo, raw.machine) if raw.cpuinfo else
               CPUInfo("unknown CPU", raw.machine, raw.cpu_count or 1, raw.cpu_count or 1))
        ram_total, ram_available = parse_meminfo(raw.meminfo) if raw.meminfo else (0, None)
    if not ram_total:
        notes.append("could not read the amount of RAM; memory checks assume 8 GiB")
        ram_total = 8 * GiB

    gpus: list[GPUInfo] = []
    if raw.nvidia_smi is not None:
        try:
            gpus = parse_nvidia_smi(raw.nvidia_smi)
        except HardwareParseError as exc:
            notes.append(f"nvidia-smi output not understood ({exc}); using the CPU")
        if raw.nvidia_smi is not None and not gpus and not notes:
            notes.append("nvidia-smi lists no GPU; using the CPU")
    elif raw.nvidia_smi_error and not apple_chip:
        notes.append(f"no NVIDIA GPU detected ({raw.nvidia_smi_error}); using the CPU")
    if apple_chip:
        limit = apple_gpu_limit(ram_total, _int(sysctl.get("iogpu.wired_limit_mb")) or 0)
        gpus.append(GPUInfo("apple", f"{apple_chip} GPU", ram_total, limit, unified=True))

    backend = raw.backend
    if backend is not None:
        if backend.gpu_offload is None:
            notes.append(f"llama-cpp-python could not be loaded ({backend.error}); "
                         f"{rebuild_hint()}")
        elif not backend.gpu_offload and gpus:
            kind = "cuda" if gpus[0].vendor == "nvidia" else "metal"
            warnings.append(
                f"llama-cpp-python was built for the CPU only, so the {gpus[0].name} sits idle "
                f"and both models run on the CPU. {rebuild_hint(kind, 'with GPU support')}")
    release = sysctl.get("kern.osproductversion", "") or raw.release
    return Hardware(os=system, os_release=release, cpu=cpu, ram_total=ram_total,
                    ram_available=ram_available, gpus=tuple(gpus), apple_chip=apple_chip,
                    backend=backend, notes=tuple(notes), warnings=tuple(warnings))


def _int(value: str | None) -> int | None:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------------- probe

Runner = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def probe_nvidia_smi(run: Runner = _run) -> tuple[str | None, str | None]:
    """(stdout, None) when nvidia-smi answered, else (None, why not)."""
    try:
        res = run(NVIDIA_SMI_QUERY, 15.0)
    except FileNotFoundError:
        return None, "nvidia-smi not found"
    except subprocess.TimeoutExpired:
        return None, "nvidia-smi timed out"
    except OSError as exc:
        return None, f"nvidia-smi could not run: {exc.strerror or exc}"
    if res.returncode != 0:
        first = (res.stdout or res.stderr or "").strip().splitlines()
        return None, f"nvidia-smi failed (exit {res.returncode}: {first[0][:100] if first else ''})"
    return res.stdout, None


def probe_backend() -> BackendInfo:
    """Ask the installed binding; importing it is the only way to know how it was built."""
    try:
        from tandem.engine.backend import llama
    except Exception as exc:  # noqa: BLE001 - a broken build must not break detection
        return BackendInfo("unknown", None, "", error=str(getattr(exc, "message", exc)))
    try:
        return BackendInfo(llama.LLAMA_CPP_VERSION, llama.supports_gpu_offload(),
                           llama.system_info())
    except Exception as exc:  # noqa: BLE001
        return BackendInfo(llama.LLAMA_CPP_VERSION, None, "", error=str(exc))


def _probe_sysctl(run: Runner) -> str | None:
    try:
        res = run(["sysctl", *SYSCTL_KEYS], 10.0)
        if res.returncode == 0:
            return res.stdout
        # a key this macOS lacks (iogpu.* before macOS 14) may end the listing: ask one by one
        return "".join(run(["sysctl", key], 5.0).stdout for key in SYSCTL_KEYS)
    except (OSError, subprocess.SubprocessError):
        return None


def probe(run: Runner = _run, read: Callable[[str], str | None] = _read,
          with_backend: bool = True) -> RawProbe:
    """Collect the raw detection text from this machine (commands and files)."""
    system = platform.system()
    cpuinfo = meminfo = sysctl = None
    if system == "Darwin":
        sysctl = _probe_sysctl(run)
    else:
        cpuinfo = read("/proc/cpuinfo")
        meminfo = read("/proc/meminfo")
    smi, smi_error = probe_nvidia_smi(run) if system != "Darwin" else (None, "macOS")
    return RawProbe(system=system, machine=platform.machine(), release=platform.release(),
                    cpuinfo=cpuinfo, meminfo=meminfo, sysctl=sysctl, nvidia_smi=smi,
                    nvidia_smi_error=smi_error, cpu_count=os.cpu_count(),
                    backend=probe_backend() if with_backend else None)


def detect(with_backend: bool = True) -> Hardware:
    """Detect this machine's hardware (runs nvidia-smi / sysctl; about 0.1 s)."""
    return from_probe(probe(with_backend=with_backend))
