"""The ops backend (conveyor/ops/backend.py): chosen in one place by device and dtype, its
capability flags what this machine's kernels can do, the reference's prefill attention the
kernel's contract, the runner's model and sampler on one backend, and torch.ops.conveyor
reached from one module only."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from conveyor import LLM, SamplingParams, ops
from conveyor.model.layers import PackedLinear, matmul_kernels
from conveyor.ops.backend import reference_prefill_attention

SRC = Path(__file__).resolve().parents[1] / "src" / "conveyor"


def test_the_load_log_names_the_matmul_family_the_weights_took() -> None:
    """``matmul_kernels`` (the load log's "matmuls:" line) says what ``PackedLinear`` chose,
    with ``amx_matmuls`` on and off, whatever this CPU (AMX: the tiles, then the dot kernels;
    Zen 4: the dot kernels either way)."""
    weight = torch.randn(64, 128).to(torch.bfloat16)
    for amx in (True, False):
        text = matmul_kernels(torch.bfloat16, amx)
        assert text.startswith("the AVX512-BF16 dot kernels") == PackedLinear(weight, None, amx).dot
        assert text.startswith("AMX tiles") == (amx and ops.amx_available())


def test_select_backend_by_device_and_dtype() -> None:
    assert ops.load_cpu_kernels(), "the C++ kernels must build on this machine (g++ and ninja)"
    cpu = torch.device("cpu")
    f32, bf16 = ops.select_backend(cpu, torch.float32), ops.select_backend(cpu, torch.bfloat16)
    for backend in (f32, bf16):
        assert isinstance(backend, ops.CpuKernelBackend)
        assert backend.name == "cpu" and backend.fused_decode
    assert f32.prefill_rows_as_decodes and not f32.prefill_attention_kernel
    assert f32.quantized_matmuls == ops.f32_kernels_available()
    assert not bf16.prefill_rows_as_decodes
    assert bf16.prefill_attention_kernel == ops.prefill_attention_available()
    assert bf16.quantized_matmuls == (ops.amx_available() or ops.dot_kernels_available())
    assert not ops.select_backend(cpu, torch.float16).quantized_matmuls
    # torch.device("cuda") needs no GPU to be named: the choice is by device type.
    cuda = ops.select_backend(torch.device("cuda"), torch.bfloat16)
    other = ops.select_backend(torch.device("meta"), torch.float32)
    assert isinstance(cuda, ops.CudaBackend) and cuda.name == "cuda"
    assert isinstance(other, ops.ReferenceBackend) and other.name == "reference"
    for backend in (cuda, other):
        assert not (backend.fused_decode or backend.quantized_matmuls
                    or backend.prefill_attention_kernel or backend.prefill_rows_as_decodes)
    assert other.step_attention is None


def test_reference_prefill_attention_is_causal_over_the_prefix_with_gqa() -> None:
    """Query i of a chunk at positions offset.. attends to keys 0..offset+i; head h reads KV
    head h // (H / KVH). Checked against the softmax written out in float64."""
    gen = torch.Generator().manual_seed(2)
    length, offset, heads, kv_heads, head_dim = 5, 3, 6, 2, 8
    q = torch.randn(length, heads, head_dim, generator=gen)
    k = torch.randn(offset + length, kv_heads, head_dim, generator=gen)
    v = torch.randn(offset + length, kv_heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    out = reference_prefill_attention(q, k, v, offset, scale)
    assert out.shape == q.shape
    want = torch.empty(length, heads, head_dim, dtype=torch.float64)
    for i in range(length):
        for h in range(heads):
            keys = k[:offset + i + 1, h // (heads // kv_heads)].double()
            values = v[:offset + i + 1, h // (heads // kv_heads)].double()
            weights = torch.softmax(keys @ q[i, h].double() * scale, 0)
            want[i, h] = weights @ values
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_the_runner_runs_model_and_sampler_on_one_backend(tiny_llama_dir, kv_free) -> None:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=1 << 20,
              max_model_len=256)
    runner = llm.engine.runner
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9] * 11}]
    assert isinstance(runner.model.backend, ops.CpuKernelBackend)
    assert runner.sampler.backend is runner.model.backend
    assert runner.model._fused_decode is not None  # decode-only steps: model/cpu_decode.py
    assert all(len(o.outputs[0].token_ids) == 4 for o in llm.generate(prompts, greedy))
    runner.use_backend(ops.ReferenceBackend())
    assert runner.sampler.backend is runner.model.backend
    assert runner.model._fused_decode is None  # the reference has no fused loop
    assert all(len(o.outputs[0].token_ids) == 4 for o in llm.generate(prompts, greedy))
    kv_free(llm)


def test_switching_to_the_reference_takes_the_cache_back_to_rows(kv_free) -> None:
    """The default engine (its cache in the tile layout on a CPU with bf16 products) switched to the
    reference ops after a request: the cache becomes rows (reference.tiles_as_rows, which
    keeps what the blocks hold: tests/test_ops.py), and the next request gets the output of
    an engine that ran the reference from the start."""
    from conftest_models import default_gguf

    default_gguf()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = "Explain why the sky is blue in two sentences."

    def engine() -> LLM:
        return LLM(kv_cache_memory="32MiB", max_model_len=256)

    fresh = engine()
    fresh.engine.runner.use_backend(ops.ReferenceBackend())
    expected = fresh.generate([prompt], greedy)[0].outputs[0].token_ids
    switched = engine()
    switched.generate(["The capital of France is"], greedy)
    switched.engine.runner.use_backend(ops.ReferenceBackend())
    assert not switched.engine.runner.layout.tiles
    assert switched.engine.runner.kv_caches.dim() == 6  # [layers, 2, blocks, bs, KVH, D]
    assert switched.generate([prompt], greedy)[0].outputs[0].token_ids == expected
    kv_free(switched)


def _reaches_torch_ops_conveyor(path: Path) -> list[int]:
    """Lines of ``path`` that name ``torch.ops.conveyor`` in code (docstrings aside)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr == "conveyor"
            and ast.unparse(node.value) == "torch.ops"]


def test_only_cpu_kernels_reaches_torch_ops_conveyor() -> None:
    found = {str(p.relative_to(SRC)): lines for p in SRC.rglob("*.py")
             if (lines := _reaches_torch_ops_conveyor(p))}
    assert set(found) == {"ops/cpu_kernels.py"}, found
