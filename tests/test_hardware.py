"""Hardware detection: recorded nvidia-smi / sysctl / /proc outputs replayed through the parsers."""
from __future__ import annotations

import subprocess
from dataclasses import replace

import pytest
from hw_fixtures import CPU_ONLY, CUDA, machine, raw, text
from tandem.machine import hardware
from tandem.machine.hardware import (
    BackendInfo,
    GiB,
    HardwareParseError,
    MiB,
    apple_gpu_limit,
    from_probe,
    parse_cpuinfo,
    parse_meminfo,
    parse_nvidia_smi,
    parse_sysctl,
    parse_system_info,
    probe_nvidia_smi,
)


def test_nvidia_smi_rtx4090():
    (gpu,) = parse_nvidia_smi(text("nvidia-smi-rtx4090.csv"))
    assert gpu.name == "NVIDIA GeForce RTX 4090"
    assert gpu.vendor == "nvidia" and not gpu.unified
    assert gpu.memory_total == 24564 * MiB
    assert gpu.memory_free == 24080 * MiB


def test_nvidia_smi_rtx4080_and_multi_gpu():
    (gpu,) = parse_nvidia_smi(text("nvidia-smi-rtx4080.csv"))
    assert gpu.name == "NVIDIA GeForce RTX 4080" and gpu.memory_total == 16376 * MiB
    two = parse_nvidia_smi("NVIDIA GeForce RTX 3090, 24576, 20000\n"
                           "NVIDIA GeForce RTX 3090, 24576, [N/A]\n")
    assert [g.index for g in two] == [0, 1]
    assert two[1].memory_free is None  # unknown free memory is not zero


def test_nvidia_smi_garbage_is_a_parse_error():
    with pytest.raises(HardwareParseError):
        parse_nvidia_smi(text("nvidia-smi-failed.txt"))


def test_rtx4090_machine():
    hw = machine("rtx4090")
    assert hw.vendor == "nvidia"
    assert hw.device_name == "NVIDIA GeForce RTX 4090"
    assert hw.device_id == "nvidia-geforce-rtx-4090"
    assert hw.accelerator_memory == 24564 * MiB
    assert hw.gpu_free == 24080 * MiB
    assert hw.cpu.model == "AMD Ryzen 9 7950X 16-Core Processor"
    assert (hw.cpu.physical_cores, hw.cpu.logical_cores) == (16, 32)
    assert "avx512f" in hw.cpu.flags and "avx2" in hw.cpu.simd
    assert hw.ram_total == 65536788 * 1024 and hw.ram_available == 60442316 * 1024
    assert hw.backend.name == "cuda" and not hw.warnings


def test_cpu_box_this_machine_recording():
    hw = machine("cpu-box")
    assert hw.vendor == "cpu" and hw.gpus == () and hw.gpu_free is None
    assert hw.cpu.model == "Intel(R) Xeon(R) Processor"
    assert (hw.cpu.physical_cores, hw.cpu.logical_cores) == (2, 2)
    assert {"avx2", "avx512f", "amx_tile"} <= hw.cpu.flags
    assert hw.ram_total == 24683656 * 1024
    assert any("nvidia-smi not found" in n for n in hw.notes)
    assert hw.backend.name == "cpu" and not hw.warnings  # no GPU: a CPU build is right


def test_m2_ultra_sysctl():
    hw = machine("m2-ultra")
    assert hw.vendor == "apple" and hw.apple_chip == "Apple M2 Ultra"
    assert hw.os == "darwin" and hw.os_release == "14.6.1"
    assert hw.ram_total == 192 * GiB and hw.ram_available is None
    assert hw.cpu.physical_cores == 16 and hw.cpu.logical_cores == 24  # performance cores
    assert {"neon", "dotprod", "i8mm", "bf16"} <= hw.cpu.flags
    (gpu,) = hw.gpus
    assert gpu.unified and gpu.vendor == "apple"
    assert gpu.memory_free == int(192 * GiB * 0.75)  # macOS's default Metal share from 64 GB up
    assert hw.device_id == "apple-m2-ultra"
    assert hw.backend.name == "metal"


def test_apple_wired_limit_override_and_small_machines():
    assert apple_gpu_limit(192 * GiB, 180 * 1024) == 180 * GiB
    assert apple_gpu_limit(16 * GiB) == int(16 * GiB * 0.67)
    sysctl = text("sysctl-m2-ultra.txt").replace("iogpu.wired_limit_mb: 0",
                                                 "iogpu.wired_limit_mb: 172032")
    hw = from_probe(replace(raw("m2-ultra"), sysctl=sysctl))
    assert hw.gpu_free == 172032 * MiB


def test_nvidia_smi_failing_falls_back_to_cpu_with_a_note():
    hw = from_probe(raw("rtx4090", nvidia_smi=None,
                        nvidia_smi_error="nvidia-smi failed (exit 9: NVIDIA-SMI has failed)"))
    assert hw.vendor == "cpu" and hw.gpus == ()
    assert any("nvidia-smi failed" in n and "using the CPU" in n for n in hw.notes)
    # garbage on stdout with exit 0 is not trusted either
    hw = from_probe(raw("rtx4090", nvidia_smi=text("nvidia-smi-failed.txt")))
    assert hw.vendor == "cpu" and any("not understood" in n for n in hw.notes)


def test_probe_nvidia_smi_missing_failing_and_timing_out():
    def missing(argv, timeout):
        raise FileNotFoundError(argv[0])

    assert probe_nvidia_smi(missing) == (None, "nvidia-smi not found")

    def failing(argv, timeout):
        return subprocess.CompletedProcess(argv, 9, text("nvidia-smi-failed.txt"), "")

    out, why = probe_nvidia_smi(failing)
    assert out is None and why.startswith("nvidia-smi failed (exit 9: NVIDIA-SMI has failed")

    def hanging(argv, timeout):
        raise subprocess.TimeoutExpired(argv, timeout)

    assert probe_nvidia_smi(hanging) == (None, "nvidia-smi timed out")

    def working(argv, timeout):
        assert argv == hardware.NVIDIA_SMI_QUERY
        return subprocess.CompletedProcess(argv, 0, text("nvidia-smi-rtx4090.csv"), "")

    assert probe_nvidia_smi(working) == (text("nvidia-smi-rtx4090.csv"), None)


def test_gpu_with_cpu_only_binding_warns_with_the_exact_fix():
    hw = machine("rtx4090", backend=CPU_ONLY)
    assert hw.vendor == "nvidia"  # a fact about the machine, whatever the binding
    (w,) = hw.warnings
    assert "NVIDIA GeForce RTX 4090" in w and "-DGGML_CUDA=on" in w
    assert "pip install --force-reinstall --no-cache-dir --no-binary llama-cpp-python" in w
    hw = machine("m2-ultra", backend=CPU_ONLY)
    assert "-DGGML_METAL=on" in hw.warnings[0] and "-DGGML_CUDA" not in hw.warnings[0]


def test_unloadable_binding_is_a_note():
    hw = machine("cpu-box", backend=BackendInfo("unknown", None, "", error="no module"))
    assert hw.backend.name == "unknown"
    assert any("CMAKE_ARGS=" in n and "-m pip install" in n for n in hw.notes)


def test_system_info_and_ggml_features():
    info = parse_system_info(CUDA.system_info)
    assert info["CPU"]["AVX2"] == "1" and info["CUDA"]["ARCHS"] == "890"
    hw = machine("rtx4090")
    assert {"avx2", "repack"} <= hw.ggml_cpu_features
    assert "avx512" not in hw.ggml_cpu_features  # the binding decides, not the CPU's flags
    hw = machine("cpu-box", backend=None)
    assert {"avx2", "avx512"} <= hw.ggml_cpu_features  # no binding: from the CPU's flags
    assert BackendInfo("x", True, "CPU : NEON = 1 | Metal : EMBED_LIBRARY = 1 |").name == "metal"
    assert BackendInfo("x", True, "CPU : AVX = 1 | Vulkan : X = 1 |").name == "vulkan"


def test_parse_cpuinfo_arm_and_meminfo():
    arm = ("processor\t: 0\nBogoMIPS\t: 48.00\nFeatures\t: fp asimd evtstrm aes asimddp\n"
           "CPU implementer\t: 0x41\nCPU part\t: 0xd0c\n\n"
           "processor\t: 1\nFeatures\t: fp asimd evtstrm aes asimddp\nCPU part\t: 0xd0c\n")
    cpu = parse_cpuinfo(arm, "aarch64")
    assert cpu.logical_cores == 2 and cpu.physical_cores == 2
    assert {"neon", "dotprod"} <= cpu.flags and "0xd0c" in cpu.model
    assert parse_meminfo("MemTotal: 1024 kB\nMemAvailable: 512 kB\n") == (1 << 20, 1 << 19)
    with pytest.raises(HardwareParseError):
        parse_meminfo("nothing here")
    assert parse_sysctl("hw.memsize: 8\nkern.x = y\n") == {"hw.memsize": "8", "kern.x": "y"}


def test_detect_on_this_machine():
    hw = hardware.detect()
    assert hw.cpu.logical_cores >= 1 and hw.ram_total > 0
    assert hw.backend is not None and hw.backend.gpu_offload is not None
    d = hw.to_dict()
    assert d["vendor"] == hw.vendor and "flags" not in d["cpu"]


def test_probe_on_macos_asks_sysctl_key_by_key_when_one_is_missing(monkeypatch):
    recorded = dict(line.split(": ", 1) for line in text("sysctl-m2-ultra.txt").splitlines())
    calls = []

    def fake_sysctl(argv, timeout):
        calls.append(argv)
        if len(argv) > 2:  # the combined call: an old macOS without iogpu.wired_limit_mb
            return subprocess.CompletedProcess(argv, 1, "hw.memsize: 1\n", "unknown oid")
        key = argv[1]
        out = f"{key}: {recorded[key]}\n" if key in recorded and "iogpu" not in key else ""
        return subprocess.CompletedProcess(argv, 0 if out else 1, out, "")

    monkeypatch.setattr(hardware.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(hardware.platform, "machine", lambda: "arm64")
    raw_probe = hardware.probe(run=fake_sysctl, with_backend=False)
    assert len(calls) == 1 + len(hardware.SYSCTL_KEYS)
    hw = from_probe(raw_probe)
    assert hw.apple_chip == "Apple M2 Ultra" and hw.ram_total == 192 * GiB
    assert hw.gpu_free == int(192 * GiB * 0.75)
