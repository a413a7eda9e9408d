"""Built-in model shapes and accelerator specs for ``conveyor plan``.

Model shapes are the published Hugging Face ``config.json`` values. Device figures are the
vendors' datasheet numbers: memory in GB (1 GB = 1e9 bytes, as on the datasheets), peak
memory bandwidth in GB/s, and dense bf16 tensor-core TFLOP/s (no sparsity).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from conveyor.config import ModelConfig
from conveyor.planner.plan import DeviceSpec

GB = 1e9  # decimal gigabyte: device sizes and bandwidths are quoted this way
TFLOP = 1e12

T = TypeVar("T")

MODEL_PRESETS: dict[str, ModelConfig] = {
    "llama-2-7b": ModelConfig(
        architecture="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
        rms_norm_eps=1e-5, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    "llama-2-13b": ModelConfig(
        architecture="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40, head_dim=128,
        rms_norm_eps=1e-5, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    "llama-2-70b": ModelConfig(
        architecture="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    "llama-3-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        bos_token_id=128000, eos_token_ids=(128001,)),
    "llama-3-70b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        bos_token_id=128000, eos_token_ids=(128001,)),
    "mistral-7b": ModelConfig(  # Mistral-7B-v0.1
        architecture="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,)),
    "qwen2.5-7b": ModelConfig(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=131072,
        attention_bias=True, bos_token_id=151643, eos_token_ids=(151643,)),
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True, qk_norm=True, bos_token_id=151643, eos_token_ids=(151645,)),
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
}


def _device(name: str, memory_gb: float, bandwidth_gbs: float, tflops: float) -> DeviceSpec:
    return DeviceSpec(name=name, memory_bytes=memory_gb * GB,
                      bandwidth_bytes_per_s=bandwidth_gbs * GB, flops_per_s=tflops * TFLOP)


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        _device("A10G", 24, 600, 125),
        _device("L4", 24, 300, 121),
        _device("A100-40GB", 40, 1555, 312),
        _device("A100-80GB", 80, 2039, 312),
        _device("H100-80GB", 80, 3350, 989),
        _device("H200", 141, 4800, 989),
    )
}


# Device-to-device links for tensor parallelism: bandwidth in GB/s, one direction per GPU.
LINK_PRESETS: dict[str, float] = {
    "nvlink3": 300 * GB,  # A100 NVLink 3 (600 GB/s both directions)
    "nvlink4": 450 * GB,  # H100/H200 NVLink 4 (900 GB/s both directions)
    "pcie4": 32 * GB,  # PCIe 4.0 x16
    "pcie5": 64 * GB,  # PCIe 5.0 x16
}
# The link each device preset usually comes with (SXM boards; the L4 and A10G are PCIe cards).
DEVICE_LINKS = {"A10G": "pcie4", "L4": "pcie4", "A100-40GB": "nvlink3", "A100-80GB": "nvlink3",
                "H100-80GB": "nvlink4", "H200": "nvlink4"}


def _lookup(table: Mapping[str, T], name: str, flag: str) -> T:
    # Case-insensitive: "a100-80gb" and "Llama-2-7B" are what people type.
    by_lower = {key.lower(): key for key in table}
    key = by_lower.get(name.lower())
    if key is None:
        raise ValueError(f"{flag}: unknown preset {name!r}; known: {', '.join(table)}")
    return table[key]


def model_preset(name: str) -> ModelConfig:
    """The built-in ``ModelConfig`` called ``name`` (case-insensitive)."""
    return _lookup(MODEL_PRESETS, name, "--model")


def device_preset(name: str) -> DeviceSpec:
    """The built-in ``DeviceSpec`` called ``name`` (case-insensitive)."""
    return _lookup(DEVICE_PRESETS, name, "--device")


def link_preset(name: str) -> float:
    """Bytes/s of the built-in link called ``name`` (case-insensitive)."""
    return _lookup(LINK_PRESETS, name, "--link")


def default_link_name(device: str) -> str:
    """The link preset a device preset usually has (PCIe 4.0 when unknown)."""
    return DEVICE_LINKS.get(device, "pcie4")


def default_link(device: str) -> float:
    """Bytes/s of the link a device preset usually has (PCIe 4.0 when unknown)."""
    return LINK_PRESETS[default_link_name(device)]
