"""Where a target's layers go when llama.cpp RPC servers hold some of them, and what crosses
the link per token. Pure arithmetic on the model's shape and the servers' reported memory.

llama.cpp's rule (vendored src/llama-model.cpp, load_tensors): with n_gpu_layers = L the
layers il >= n_layer + 1 - L (the output layer counting as il = n_layer) are offloaded, the
input layer never; offloaded layer il goes to device upper_bound(splits, (il - start) / L),
where splits are the devices' cumulative shares of their free memory (RPC devices come first
in the device list, in the order of --rpc). Each layer's KV cache lives on the layer's device.

Across the link per token: the hidden state (n_embd floats) wherever two consecutive layers
sit on different devices (between two servers it goes through this machine, so twice), and
the logits row (n_vocab floats) when the output layer is remote. llama.cpp's graph messages
and masks add to it and are not counted here.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

from tandem.fsutil import fmt_bytes
from tandem.machine.placement import F32, ContextSpec, place
from tandem.machine.shapes import ModelShape, row_bytes


@dataclass(frozen=True)
class DevicePlan:
    device: str  # RPC0, RPC1, ... (llama.cpp's names, in --rpc order) or CPU
    endpoint: str  # HOST:PORT, "" for this machine
    layers: tuple[int, ...]  # repeating layers held; the output layer is `output`
    output: bool
    weights: int
    kv: int
    compute: int
    free: int | None = None  # what the server reported

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    @property
    def fits(self) -> bool:
        return self.free is None or self.total <= self.free

    def to_dict(self) -> dict:
        return {"device": self.device, "endpoint": self.endpoint, "layers": list(self.layers),
                "output": self.output, "weights": self.weights, "kv": self.kv,
                "compute": self.compute, "total": self.total, "free": self.free}


@dataclass(frozen=True)
class RemotePlan:
    gpu_layers: int
    devices: tuple[DevicePlan, ...]  # this machine's CPU first, then the servers' devices
    crossings: int  # hidden-state transfers over the link per token
    link_up: int  # bytes per token this machine sends
    link_down: int  # bytes per token (and per logits row) it receives
    problems: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        return {"gpu_layers": self.gpu_layers, "devices": [d.to_dict() for d in self.devices],
                "crossings_per_token": self.crossings, "link_bytes_up_per_token": self.link_up,
                "link_bytes_down_per_token": self.link_down, "problems": list(self.problems)}


def assign_layers(n_layer: int, gpu_layers: int, free: Sequence[int]) -> list[int]:
    """Device index per layer 0..n_layer (n_layer: the output); -1 is this machine's CPU."""
    top = n_layer + 1
    n = top if gpu_layers < 0 else min(gpu_layers, top)
    if not free or n == 0:
        return [-1] * top
    total = float(sum(free)) or float(len(free))
    shares = [f / total if sum(free) else 1 / len(free) for f in free]
    splits, acc = [], 0.0
    for s in shares:
        acc += s
        splits.append(acc)
    start = top - n
    out = []
    for il in range(top):
        if il < start:
            out.append(-1)
        else:
            out.append(min(bisect.bisect_right(splits, (il - start) / n), len(free) - 1))
    return out


def plan_remote(shape: ModelShape, ctx: ContextSpec, gpu_layers: int,
                servers: Sequence[tuple[str, Sequence[tuple[int, int]]]]) -> RemotePlan:
    """`servers`: (endpoint, [(free, total) per device]) in --rpc order."""
    devs: list[tuple[str, str, int]] = []  # (name, endpoint, free)
    for endpoint, memory in servers:
        for free, _total in memory:
            devs.append((f"RPC{len(devs)}", endpoint, free))
    where = assign_layers(shape.n_layer, gpu_layers, [d[2] for d in devs])
    n_off = sum(1 for w in where if w >= 0)
    ref = place(shape, ctx, n_off, role="target", backend="rpc")
    cells = ctx.cells

    def kv(il: int) -> int:
        kvh = shape.n_head_kv[il]
        return cells * (row_bytes(ctx.type_k, shape.head_dim_k * kvh)
                        + row_bytes(ctx.type_v, shape.head_dim_v * kvh))

    plans = []
    for i in [-1] + list(range(len(devs))):
        layers = tuple(il for il in range(shape.n_layer) if where[il] == i)
        output = where[shape.n_layer] == i
        weights = sum(shape.layer_bytes[il] for il in layers)
        if output:
            weights += shape.output_bytes + (shape.embd_bytes if shape.tied_output and i >= 0
                                             else 0)
        if i == -1:
            weights += shape.input_bytes
            plans.append(DevicePlan("CPU", "", layers, output, weights,
                                    sum(kv(il) for il in layers), ref.compute_cpu
                                    + ref.output_host))
        else:
            name, endpoint, free = devs[i]
            used = bool(layers) or output
            plans.append(DevicePlan(name, endpoint, layers, output, weights,
                                    sum(kv(il) for il in layers),
                                    ref.compute_gpu if used else 0, free))
    # the hidden state goes from the input (CPU) through the layers in order, then to the
    # output's device (where[n_layer])
    hidden = F32 * shape.n_embd
    up = down = crossings = 0
    prev = -1
    for cur in where[:shape.n_layer + 1]:
        if cur != prev:
            if prev >= 0:
                down += hidden
                crossings += 1
            if cur >= 0:
                up += hidden
                crossings += 1
        prev = cur
    out_dev = where[shape.n_layer]
    if out_dev >= 0:
        down += F32 * shape.n_vocab  # the logits row comes back
        crossings += 1
    problems = tuple(f"{d.device} ({d.endpoint}) needs {fmt_bytes(d.total)} but reports "
                     f"{fmt_bytes(d.free)} free" for d in plans if not d.fits)
    return RemotePlan(gpu_layers, tuple(plans), crossings, up, down, problems)
