"""Capacity arithmetic: weights, KV cache and the decode roofline on one kind of device.

Pure functions over ``ModelConfig`` and ``DeviceSpec``; no I/O. Units: bytes, seconds,
FLOP/s. Device sizes come in decimal units (1 GB = 1e9 bytes) throughout.

The decode model is the usual roofline. One decode step reads every weight once and the KV
of every running sequence, and does ``2 * num_parameters`` FLOPs per sequence:

    memory_time  = (weight_bytes + batch * seq_len * kv_bytes_per_token) / bandwidth
    compute_time = 2 * num_parameters * batch / flops
    step_time    = max(memory_time, compute_time);  tokens/s = batch / step_time

Setting the two equal gives the batch where decode turns compute-bound; when the KV term is
small it is ``ops_per_byte * dtype_bytes / 2``, i.e. the device's ops:byte ratio in fp16.
Tensor parallelism over ``tp`` devices, split as the engine splits (``tp`` at most the KV
heads, which need not divide evenly: ``conveyor.config.check_tensor_parallel``): each device
holds about ``1/tp`` of the weights and its KV cache is sized for the rank with the most KV
heads, ``ceil(num_kv_heads / tp)`` (``CapacityPlan`` is that roofline alone); every layer
adds two ring all-reduces of the step's hidden states over the device link, in which each
device sends ``2 (tp - 1) / tp * hidden_size * dtype_bytes`` per token
(``allreduce_time``; ``plan_parallel`` adds it to the decode step, for ``replicas`` copies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.config import (
    INT8_KV_SCALE_BYTES,
    ModelConfig,
    check_tensor_parallel,
    max_tensor_parallel_size,
)

# Bytes per element of a weight or KV dtype, by the names --dtype/--kv-dtype accept.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "int8": 1,
    "fp8": 1, "float8": 1,
}

# Bytes of scale per token, layer, KV head and K/V, by --kv-dtype: conveyor's int8 cache's.
KV_SCALE_BYTES: dict[str, int] = {"int8": INT8_KV_SCALE_BYTES}


def kv_dtype_scale_bytes(kv_dtype: str) -> int:
    """Bytes of scale per token, layer, KV head and K/V of a ``--kv-dtype`` (0: none)."""
    return KV_SCALE_BYTES.get(kv_dtype.lower(), 0)


# Each ring all-reduce also pays a launch/synchronisation latency (NCCL small-message figure).
ALLREDUCE_LATENCY_S = 10e-6
# The flag that names the tensor-parallel size in the planner's errors.
TP_FLAG = "--tensor-parallel-size"
# All-reduces per layer under tensor parallelism: after attention (o_proj) and after the MLP.
ALLREDUCES_PER_LAYER = 2


def dtype_bytes(name: str, flag: str = "--dtype") -> int:
    """Bytes per element for a dtype name such as ``"float16"`` or ``"fp8"``."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ValueError(f"{flag}: unknown dtype {name!r}; known: "
                         f"{', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or this machine): memory size, memory bandwidth and peak compute."""

    name: str
    memory_bytes: float  # usable device memory, bytes (1 GB = 1e9)
    bandwidth_bytes_per_s: float  # peak memory bandwidth, bytes/s
    flops_per_s: float  # peak dense bf16/fp16 matmul throughput, FLOP/s

    def __post_init__(self) -> None:
        for name, flag, unit in (("memory_bytes", "--memory-gb", 1e9),
                                 ("bandwidth_bytes_per_s", "--bandwidth-gbs", 1e9),
                                 ("flops_per_s", "--tflops", 1e12)):
            value = getattr(self, name)
            if not 0 < value < math.inf:  # in the flag's unit, as the user wrote it
                raise ValueError(f"{flag} must be a finite number > 0, got {value / unit:g} "
                                 f"for device {self.name!r}")

    @property
    def ops_per_byte(self) -> float:
        """FLOPs the device can do in the time it reads one byte from memory."""
        return self.flops_per_s / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class DecodeBound:
    """The roofline bound on one decode step at a given batch size (per device)."""

    batch: int  # sequences decoded together, one token each
    memory_time_s: float  # time to read the weights and the batch's KV once
    compute_time_s: float  # time for 2 * num_parameters * batch FLOPs
    step_time_s: float  # max of the two
    tokens_per_s: float  # batch / step_time_s, for the whole tensor-parallel group
    bound: str  # "memory" | "compute"


@dataclass(frozen=True)
class CapacityPlan:
    """How a model fits on ``tp`` devices of one kind, and how fast it can decode there."""

    num_parameters: int  # whole model
    tp: int  # tensor-parallel devices this plan is for
    seq_len: int  # average tokens (prompt + output) per sequence
    weight_bytes: int  # whole model
    weight_bytes_per_device: float  # weight_bytes / tp
    kv_bytes_per_token: int  # K and V, all layers, all KV heads
    kv_bytes_per_token_per_device: int  # for the ceil(num_kv_heads / tp) heads one device holds
    activation_reserve_bytes: float  # per device, kept for activations and workspace
    kv_budget_bytes: float  # per device: memory - weights - reserve, floored at 0
    weights_fit: bool  # the weights (and the reserve) fit in memory at all
    kv_tokens: int  # tokens of KV the group can hold
    max_concurrent_seqs: int  # kv_tokens // seq_len
    ops_per_byte: float  # device FLOP/s / bytes/s
    decode: DecodeBound  # at the requested batch
    decode_at_max_concurrency: DecodeBound | None  # at max_concurrent_seqs; None if 0
    compute_bound_batch: float | None  # batch where decode turns compute-bound; None: never
    compute_bound_batch_weights_only: float  # the same ignoring KV reads: ops:byte * bytes / 2
    min_tp: int | None  # fewest devices (a power of two the engine accepts) holding weights
    #                     + batch sequences; None: no such split exists
    min_tp_divides_kv_heads: bool  # min_tp splits the KV heads evenly (else unevenly)


def reserve_bytes(device: DeviceSpec, activation_reserve: float) -> float:
    """Device memory held back from the KV cache: ``activation_reserve`` is a fraction of
    memory below 1, else bytes; ValueError naming --activation-reserve when negative or
    when it takes the whole device (the plan would blame the weights)."""
    if not activation_reserve >= 0:
        raise ValueError(f"--activation-reserve must be >= 0, got {activation_reserve!r}")
    # Below 1 it is a fraction of device memory; from 1 up it is bytes (a 1-byte reserve is
    # not a thing anyone means, so the two ranges cannot be confused).
    if activation_reserve < 1:
        return activation_reserve * device.memory_bytes
    if activation_reserve >= device.memory_bytes:
        raise ValueError(f"--activation-reserve ({activation_reserve / 1e9:,.1f} GB) must be "
                         f"less than {device.name}'s memory ({device.memory_bytes / 1e9:,.1f} "
                         "GB)")
    return float(activation_reserve)


def kv_heads_per_device(config: ModelConfig, tp: int) -> int:
    """KV heads of the rank that holds the most (the first ones hold one more when ``tp``
    does not divide them); every rank's cache has as many blocks as that rank's (one block
    table), so it sizes them all."""
    return math.ceil(config.num_key_value_heads / tp)


def _kv_bytes_per_token_per_device(config: ModelConfig, kv_dtype_bytes: int, tp: int,
                                   kv_scale_bytes: int = 0) -> int:
    # kv_bytes_per_token is linear in the KV heads.
    per_head = (config.kv_bytes_per_token(kv_dtype_bytes, kv_scale_bytes)
                // config.num_key_value_heads)
    return per_head * kv_heads_per_device(config, tp)


def _kv_budget(device: DeviceSpec, weight_bytes: int, reserve_bytes: float,
               tp: int) -> float:
    return device.memory_bytes - weight_bytes / tp - reserve_bytes


def _kv_tokens(config: ModelConfig, device: DeviceSpec, weight_bytes: int,
               kv_dtype_bytes: int, reserve_bytes: float, tp: int,
               kv_scale_bytes: int = 0) -> int:
    budget = _kv_budget(device, weight_bytes, reserve_bytes, tp)
    per_token = _kv_bytes_per_token_per_device(config, kv_dtype_bytes, tp, kv_scale_bytes)
    return max(0, int(budget // per_token))


def decode_bound(config: ModelConfig, device: DeviceSpec, dtype_bytes: int,
                 kv_dtype_bytes: int, seq_len: int, batch: int, tp: int = 1,
                 kv_scale_bytes: int = 0) -> DecodeBound:
    """The roofline bound on a decode step of ``batch`` sequences of ``seq_len`` tokens."""
    params = config.num_parameters()
    kv_per_token = _kv_bytes_per_token_per_device(config, kv_dtype_bytes, tp, kv_scale_bytes)
    bytes_read = params * dtype_bytes / tp + batch * seq_len * kv_per_token
    memory_time = bytes_read / device.bandwidth_bytes_per_s
    compute_time = 2 * params * batch / (tp * device.flops_per_s)
    step_time = max(memory_time, compute_time)
    return DecodeBound(batch=batch, memory_time_s=memory_time, compute_time_s=compute_time,
                       step_time_s=step_time, tokens_per_s=batch / step_time,
                       bound="compute" if compute_time > memory_time else "memory")


def compute_bound_batch(config: ModelConfig, device: DeviceSpec, dtype_bytes: int,
                        kv_dtype_bytes: int, seq_len: int, tp: int = 1,
                        kv_scale_bytes: int = 0) -> float | None:
    """The batch where compute time catches up with memory time; None if it never does.

    Solves ``(W + B*S*k) / BW = 2*P*B / F`` for ``B``. Each extra sequence adds KV reads as
    well as FLOPs, so when its KV costs more time than its FLOPs decode stays memory-bound.
    """
    params = config.num_parameters()
    kv_per_token = _kv_bytes_per_token_per_device(config, kv_dtype_bytes, tp, kv_scale_bytes)
    weight_time = params * dtype_bytes / tp / device.bandwidth_bytes_per_s
    flops_time_per_seq = 2 * params / (tp * device.flops_per_s)
    kv_time_per_seq = seq_len * kv_per_token / device.bandwidth_bytes_per_s
    margin = flops_time_per_seq - kv_time_per_seq
    return weight_time / margin if margin > 0 else None


def min_tensor_parallel(config: ModelConfig, device: DeviceSpec, dtype_bytes: int,
                        kv_dtype_bytes: int, seq_len: int, batch: int,
                        activation_reserve: float, kv_scale_bytes: int = 0) -> int | None:
    """Fewest devices (a power of two the engine can split the model over) that hold the
    weights plus ``batch`` sequences' KV; None when no such split does."""
    reserve = reserve_bytes(device, activation_reserve)
    weight_bytes = config.num_parameters() * dtype_bytes
    tp = 1
    while tp <= max_tensor_parallel_size(config):
        tokens = _kv_tokens(config, device, weight_bytes, kv_dtype_bytes, reserve, tp,
                            kv_scale_bytes)
        if tokens >= batch * seq_len:
            return tp
        tp *= 2
    return None


def allreduce_bytes_per_token(config: ModelConfig, tp: int, dtype_bytes: int) -> float:
    """Bytes one device sends per token in one ring all-reduce of the hidden state:
    2 (tp - 1) / tp * hidden_size * dtype_bytes (0 on one device)."""
    return 2 * (tp - 1) / tp * config.hidden_size * dtype_bytes


def allreduce_time(config: ModelConfig, tp: int, dtype_bytes: int, num_tokens: int,
                   link_bytes_per_s: float) -> float:
    """Seconds a step of `num_tokens` spends in all-reduces: ALLREDUCES_PER_LAYER per layer,
    each its bytes over the link plus ALLREDUCE_LATENCY_S (0 on one device)."""
    if tp == 1:
        return 0.0
    one = (allreduce_bytes_per_token(config, tp, dtype_bytes) * num_tokens / link_bytes_per_s
           + ALLREDUCE_LATENCY_S)
    return ALLREDUCES_PER_LAYER * config.num_hidden_layers * one


def _validate(dtype_bytes: int, kv_dtype_bytes: int, seq_len: int, batch: int) -> None:
    checks = (
        (dtype_bytes > 0, "--dtype", "bytes per weight > 0", dtype_bytes),
        (kv_dtype_bytes > 0, "--kv-dtype", "bytes per KV element > 0", kv_dtype_bytes),
        (seq_len >= 1, "--seq-len", ">= 1", seq_len),
        (batch >= 1, "--batch", ">= 1", batch),
    )
    for ok, flag, allowed, value in checks:
        if not ok:
            raise ValueError(f"{flag} must be {allowed}, got {value!r}")


def plan_capacity(model_config: ModelConfig, device: DeviceSpec, dtype_bytes: int,
                  kv_dtype_bytes: int, seq_len: int, batch: int, activation_reserve: float,
                  tp: int = 1, kv_scale_bytes: int = 0) -> CapacityPlan:
    """Weights, KV capacity and decode bounds of ``model_config`` on ``tp`` x ``device``.

    ``activation_reserve`` is a fraction of device memory when below 1, else bytes; it is
    held back on every device for activations, workspace and the runtime.
    ``kv_scale_bytes``: a quantized KV cache's scale per token, layer, KV head and K/V
    (``kv_dtype_scale_bytes(kv_dtype)``).
    """
    _validate(dtype_bytes, kv_dtype_bytes, seq_len, batch)
    check_tensor_parallel(model_config, tp, TP_FLAG)
    config = model_config
    reserve = reserve_bytes(device, activation_reserve)
    params = config.num_parameters()
    weight_bytes = params * dtype_bytes
    budget = _kv_budget(device, weight_bytes, reserve, tp)
    scale = kv_scale_bytes
    kv_tokens = _kv_tokens(config, device, weight_bytes, kv_dtype_bytes, reserve, tp, scale)
    max_seqs = kv_tokens // seq_len
    at_max = (decode_bound(config, device, dtype_bytes, kv_dtype_bytes, seq_len, max_seqs, tp,
                           scale) if max_seqs > 0 else None)
    min_tp = min_tensor_parallel(config, device, dtype_bytes, kv_dtype_bytes, seq_len, batch,
                                 activation_reserve, scale)
    return CapacityPlan(
        num_parameters=params,
        tp=tp,
        seq_len=seq_len,
        weight_bytes=weight_bytes,
        weight_bytes_per_device=weight_bytes / tp,
        kv_bytes_per_token=config.kv_bytes_per_token(kv_dtype_bytes, scale),
        kv_bytes_per_token_per_device=_kv_bytes_per_token_per_device(config, kv_dtype_bytes, tp,
                                                                     scale),
        activation_reserve_bytes=reserve,
        kv_budget_bytes=max(0.0, budget),
        weights_fit=budget > 0,
        kv_tokens=kv_tokens,
        max_concurrent_seqs=max_seqs,
        ops_per_byte=device.ops_per_byte,
        decode=decode_bound(config, device, dtype_bytes, kv_dtype_bytes, seq_len, batch, tp,
                            scale),
        decode_at_max_concurrency=at_max,
        compute_bound_batch=compute_bound_batch(config, device, dtype_bytes, kv_dtype_bytes,
                                                seq_len, tp, scale),
        compute_bound_batch_weights_only=device.ops_per_byte * dtype_bytes / 2,
        min_tp=min_tp,
        min_tp_divides_kv_heads=(min_tp is not None
                                 and config.num_key_value_heads % min_tp == 0),
    )


@dataclass(frozen=True)
class ParallelPlan:
    """`replicas` copies of a `tp`-device tensor-parallel group: capacity per replica, the
    all-reduce cost per decode step over the link, decode bounds per replica and in total."""

    tp: int
    replicas: int
    num_devices: int  # tp x replicas
    link: str  # the link preset's name, or "custom"
    link_bytes_per_s: float  # one direction, per device
    allreduce_bytes_per_token_per_layer: float  # one all-reduce, sent per device
    allreduces_per_layer: int
    kv_tokens_per_replica: int
    seqs_per_replica: int  # of seq_len tokens
    seqs_total: int
    allreduce_time_s: float  # per decode step at --batch, all layers
    decode_step_s: float  # roofline step + all-reduce, at --batch
    tokens_per_s_per_replica: float  # at --batch
    tokens_per_s_total: float
    allreduce_time_at_max_s: float | None  # the same with the KV full; None: nothing fits
    tokens_per_s_per_replica_at_max: float | None
    tokens_per_s_total_at_max: float | None


def plan_parallel(config: ModelConfig, capacity: CapacityPlan, dtype_bytes: int,
                  replicas: int, link: str, link_bytes_per_s: float) -> ParallelPlan:
    """`capacity` (one tensor-parallel group) with its all-reduces, times `replicas`."""
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"--replicas must be an integer >= 1, got {replicas!r}")
    if not link_bytes_per_s > 0:
        raise ValueError(f"--link-gbs must be > 0, got {link_bytes_per_s / 1e9!r}")
    tp = capacity.tp

    def with_allreduce(bound: DecodeBound) -> tuple[float, float]:
        comm = allreduce_time(config, tp, dtype_bytes, bound.batch, link_bytes_per_s)
        return comm, bound.batch / (bound.step_time_s + comm)

    comm, per_replica = with_allreduce(capacity.decode)
    at_max = capacity.decode_at_max_concurrency
    comm_max, per_replica_max = with_allreduce(at_max) if at_max is not None else (None, None)
    return ParallelPlan(
        tp=tp, replicas=replicas, num_devices=tp * replicas, link=link,
        link_bytes_per_s=link_bytes_per_s,
        allreduce_bytes_per_token_per_layer=allreduce_bytes_per_token(config, tp, dtype_bytes),
        allreduces_per_layer=ALLREDUCES_PER_LAYER,
        kv_tokens_per_replica=capacity.kv_tokens, seqs_per_replica=capacity.max_concurrent_seqs,
        seqs_total=capacity.max_concurrent_seqs * replicas,
        allreduce_time_s=comm, decode_step_s=capacity.decode.step_time_s + comm,
        tokens_per_s_per_replica=per_replica, tokens_per_s_total=per_replica * replicas,
        allreduce_time_at_max_s=comm_max, tokens_per_s_per_replica_at_max=per_replica_max,
        tokens_per_s_total_at_max=None if per_replica_max is None
        else per_replica_max * replicas)
