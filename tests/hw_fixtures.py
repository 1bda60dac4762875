"""Recorded detection outputs (tests/data/hw/) replayed into Hardware objects.

cpuinfo/meminfo-xeon-2core: this project's 2-core VM; nvidia-smi-rtx4090/4080.csv: the
`nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv,noheader,nounits` answer of
an RTX 4090 / 4080 desktop (cpuinfo-ryzen-7950x, meminfo-64gb); sysctl-m2-ultra: `sysctl` of
the keys tandem reads on a 192 GB M2 Ultra Mac Studio; nvidia-smi-failed: a driver failure.
"""
from __future__ import annotations

from pathlib import Path

from tandem.machine.hardware import BackendInfo, Hardware, RawProbe, from_probe

DATA = Path(__file__).resolve().parent / "data" / "hw"

CUDA = BackendInfo("0.3.36", True, "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | "
                   "REPACK = 1 | CUDA : ARCHS = 890 | USE_GRAPHS = 1 | ")
METAL = BackendInfo("0.3.36", True, "CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | DOTPROD = 1 | "
                    "MATMUL_INT8 = 1 | REPACK = 1 | Metal : EMBED_LIBRARY = 1 | ")
CPU_ONLY = BackendInfo("0.3.36", False, "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | "
                       "FMA = 1 | AVX512 = 1 | REPACK = 1 | ")


def text(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def raw(kind: str, backend: BackendInfo | None = "default", **over) -> RawProbe:
    """The RawProbe of a recorded machine: rtx4090, rtx4080, m2-ultra, cpu-box."""
    if kind in ("rtx4090", "rtx4080"):
        probe = RawProbe("Linux", "x86_64", "6.8.0", cpuinfo=text("cpuinfo-ryzen-7950x.txt"),
                         meminfo=text("meminfo-64gb.txt"),
                         nvidia_smi=text(f"nvidia-smi-{kind}.csv"), cpu_count=32,
                         backend=CUDA if backend == "default" else backend)
    elif kind == "m2-ultra":
        probe = RawProbe("Darwin", "arm64", "23.6.0", sysctl=text("sysctl-m2-ultra.txt"),
                         nvidia_smi_error="macOS", cpu_count=24,
                         backend=METAL if backend == "default" else backend)
    elif kind == "cpu-box":
        probe = RawProbe("Linux", "x86_64", "6.18.44", cpuinfo=text("cpuinfo-xeon-2core.txt"),
                         meminfo=text("meminfo-xeon-2core.txt"),
                         nvidia_smi_error="nvidia-smi not found", cpu_count=2,
                         backend=CPU_ONLY if backend == "default" else backend)
    else:
        raise KeyError(kind)
    if over:
        from dataclasses import replace

        probe = replace(probe, **over)
    return probe


def machine(kind: str, **kw) -> Hardware:
    return from_probe(raw(kind, **kw))
