"""The Triton paged-attention kernel (conveyor/attention/triton_paged.py) on CPU, in Triton's
interpreter (``TRITON_INTERPRET=1``, which tests/conftest.py sets on machines without CUDA
before triton is imported), against the torch reference path: decodes of many
lengths, prefill chunks on a cached prefix, fresh prompts, recomputed generated rows, GQA
groups of 1, 2 and 3, partial last blocks, float32/float16/bfloat16. What only a GPU can
check (compilation, tensor-core numerics, speed) is in tests/test_gpu_attention.py.
"""

from __future__ import annotations

import pytest
import torch

from attention_cases import (
    Seq,
    assert_generates_as_reference,
    check_against_reference,
    compile_in_subprocess,
    make_step,
)
from conftest import TINY_KV_MEMORY
from conveyor import LLM, SamplingParams
from conveyor.attention.cuda_backend import cuda_paged_attention_backend, paged_attention_kernel
from conveyor.attention.metadata import AttentionMetadata
from conveyor.attention.paged_batch import PagedBatch, StepMemo, paged_batch
from conveyor.attention.triton_paged import (
    attend,
    interpreted,
    kernel_constants,
    triton_paged_attention,
)
from conveyor.ops import ReferenceBackend

# Tolerances against the reference: float32 exact products; half types round P (and, in the
# reference, SDPA's intermediate results) to 8 or 11 mantissa bits.
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = list(ATOL)
# (num_heads, num_kv_heads): multi-head, GQA groups of 2 and of 3 (not a power of two)
HEADS = [(4, 4), (4, 2), (6, 2)]

# Context lengths 1, 16 (a full block), 17 (one row in the next), 41 and 71 (several key tiles)
DECODES = [Seq(0, decode=True), Seq(15, decode=True), Seq(16, decode=True),
           Seq(40, decode=True), Seq(70, decode=True)]
# Decodes, a fresh prompt (no prefix: no block table), a chunk on a cached prefix that ends
# mid-block, and a chunk whose last 2 rows recompute generated tokens.
MIXED = [Seq(20, decode=True), Seq(47, decode=True), Seq(0, 19), Seq(21, 13),
         Seq(30, 6, generated_rows=2)]


# Where CUDA is (conftest leaves the variable unset), Triton compiles, for GPU tensors only:
# tests/test_gpu_attention.py runs the kernel there.
pytestmark = pytest.mark.skipif(not interpreted(), reason="Triton compiles here (CUDA): "
                                "tests/test_gpu_attention.py runs the kernel")


# Every GQA group in float32; the half types with a group of 3.
DECODE_CASES = [(torch.float32, h) for h in HEADS] + [(t, (6, 2)) for t in DTYPES[1:]]


@pytest.mark.parametrize("dtype,heads", DECODE_CASES,
                         ids=[f"{t}-h{h}kv{k}" for t, (h, k) in DECODE_CASES])
def test_decodes_match_reference(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    step = make_step(DECODES, num_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
                     block_size=16, dtype=dtype)
    check_against_reference(triton_paged_attention, step, ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_chunk_on_cached_prefix_matches_reference(dtype: torch.dtype) -> None:
    """A 40-row chunk after 33 cached keys: query tiles of the chunk see the prefix and the
    chunk's rows up to their own."""
    step = make_step([Seq(33, 40)], num_heads=6, num_kv_heads=2, head_dim=32, block_size=16,
                     dtype=dtype, seed=1)
    check_against_reference(triton_paged_attention, step, ATOL[dtype])


@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (8, 32), (16, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_step_matches_reference(dtype: torch.dtype, block_size: int,
                                      head_dim: int) -> None:
    """Decodes and prefill chunks in one launch; key tiles (32) span several 8-slot blocks;
    a head_dim that is not a power of two is padded and masked."""
    step = make_step(MIXED, num_heads=6, num_kv_heads=2, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, seed=2)
    check_against_reference(triton_paged_attention, step, ATOL[dtype])


# Compiled for a GPU without one (Triton ships ptxas): SmolLM2's decode tile (9 heads on 3 KV
# heads, bf16) for Hopper, Llama-3-8B's prefill tile (32 on 8, head_dim 128, fp16) for Ampere.
COMPILE = """
import torch
from conveyor.attention.triton_paged import compile_for
for args in [((9, 0), torch.bfloat16, 3, 64, 16, 1), ((8, 0), torch.float16, 4, 128, 16, 512),
             ((9, 0), torch.float32, 4, 8, 8, 1)]:  # head_dim 8: under tl.dot's K of 16
    kernel = compile_for(*args)
    print(args[0], len(kernel.asm["cubin"]), kernel.metadata.shared)
"""


def test_kernel_compiles_for_gpus(tmp_path) -> None:
    """What the interpreter does not check: that Triton compiles the kernel (tile shapes,
    tl.dot operand types, the early exit) to a cubin for sm_90 and sm_80, for a head_dim under
    tl.dot's smallest K (the tiny GQA test model's 8) too. In a process of its own: here
    triton was imported to interpret."""
    lines = compile_in_subprocess(COMPILE, tmp_path)
    assert [line[:2] for line in lines] == [["(9,", "0)"], ["(8,", "0)"], ["(9,", "0)"]]
    assert all(int(cubin) > 0 and int(shared) > 0 for *_, cubin, shared in lines)


def test_head_dim_tile_is_at_least_tl_dots_smallest_k() -> None:
    """Triton 3.6 (the GPU machine's) refuses a tl.dot with K < 16 (3.8's compile_for above
    takes it for float32): a head_dim of 8 (the tiny GQA model's) is padded to a 16-wide tile,
    masked like any padding; 64 and 128 stay as they are."""
    for head_dim, tile in [(8, 16), (16, 16), (24, 32), (64, 64), (128, 128)]:
        const = kernel_constants(torch.float32, 4, head_dim, 16, 1)
        assert (const["HEAD_DIM"], const["HEAD_DIM_P"]) == (head_dim, tile)


def test_every_layer_of_a_step_shares_one_batch() -> None:
    """The per-step batch: built once for a step's metadata object (and cache block size),
    again for the next step's."""
    step = make_step(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                     dtype=torch.float32)
    batch = paged_batch(step.meta, 16)
    assert batch.query_start.tolist() == [0, 1, 2, 21, 34, 40]
    assert batch.seq_lens.tolist() == [21, 48, 19, 34, 36]
    assert batch.max_query_len == 19
    # A second layer's call over the cache the first one wrote gives the same output.
    cache = step.kv_cache.clone()
    first = triton_paged_attention(step.q, step.k, step.v, cache, step.meta, step.scale)
    assert torch.equal(attend(step.q, cache, batch, step.scale), first)
    memo: StepMemo[PagedBatch] = StepMemo()
    built = memo.get(step.meta, 16, lambda: paged_batch(step.meta, 16))
    assert memo.get(step.meta, 16, lambda: pytest.fail("rebuilt for the same step")) is built
    assert memo.get(step.meta, 8, lambda: batch) is batch  # another cache's block size
    other = make_step(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                      dtype=torch.float32)
    assert memo.get(other.meta, 8, lambda: built) is built  # the next step


def test_bad_inputs_raise_value_errors() -> None:
    step = make_step(DECODES[:2], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                     dtype=torch.float32)
    batch = paged_batch(step.meta, 16)
    with pytest.raises(ValueError, match="kv_cache dtype"):
        attend(step.q, step.kv_cache.to(torch.int8), batch, step.scale)
    with pytest.raises(ValueError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
        attend(step.q[:, :3], step.kv_cache, batch, step.scale)
    with pytest.raises(ValueError, match="head_dim 16 is not the cache's 32"):
        attend(step.q[..., :16], step.kv_cache, batch, step.scale)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA: tests/test_gpu_attention.py")
def test_backend_selector_without_cuda() -> None:
    """Without a CUDA device: the torch reference; each kernel name maps to its entry point."""
    assert cuda_paged_attention_backend() == "torch"
    assert cuda_paged_attention_backend(torch.float32, kv_cache_dtype="int8") == "torch"
    assert paged_attention_kernel("triton") is triton_paged_attention
    assert paged_attention_kernel("torch") is None


class _TritonBackend(ReferenceBackend):
    """The reference ops with the Triton kernel as the step's attention: CudaBackend's
    wiring, on CPU tensors in the interpreter."""

    name = "triton-interpreted"

    def __init__(self) -> None:
        self.step_attention = triton_paged_attention


def test_an_engine_whose_backend_has_the_kernel_generates_as_the_reference(
        tiny_llama_dir, kv_free) -> None:
    """attention/paged.py hands the whole step to a backend's ``step_attention`` (CUDA's
    FlashInfer or Triton kernel): the same greedy tokens and logprobs as the reference ops,
    through chunked prefills, a prefix-cache hit and batched decodes."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=TINY_KV_MEMORY,
              max_model_len=256, max_num_batched_tokens=24, enable_prefix_caching=True)
    shared = list(range(40, 60))
    prompts = [shared + list(range(100, 117)), shared + list(range(200, 205)),
               list(range(300, 331))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    # (the Triton run's prompts find their full blocks cached: chunks on a prefix)
    assert_generates_as_reference(llm, _TritonBackend(), prompts, params, kv_free)


def test_graph_padded_decode_steps_through_the_kernel_generate_as_the_reference(
        tiny_llama_dir, kv_free, monkeypatch) -> None:
    """What a CUDA graph replays over the Triton kernel, run eagerly on CPU: decode-only
    steps padded to a bucket (padding rows at position 0, on the scratch block), their
    ``paged_batch`` built with no copy from the host (one would be captured); the same tokens
    and logprobs as the reference ops without graphs."""
    from conveyor.runner.cuda_graphs import CudaGraphSpec, graph_batch_sizes
    from conveyor.runner.model_runner import ModelRunner

    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=1 << 20,
              max_model_len=128, max_num_seqs=8, enable_prefix_caching=False)
    engine = llm.engine
    prompts = [{"prompt_token_ids": list(range(7 * i + 3, 7 * i + 3 + n))}
               for i, n in enumerate((5, 17, 3, 29, 11))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)

    def run() -> list[tuple[list[int], list[float]]]:
        outs = llm.generate(prompts, params)
        kv_free(llm)
        return [(list(o.outputs[0].token_ids),
                 [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                for o in outs]

    engine.runner.use_backend(ReferenceBackend())
    reference_out = run()
    spec = CudaGraphSpec(graph_batch_sizes(8), -(-128 // engine.kv_layout.block_size))
    runner = ModelRunner(engine.runner.model, engine.kv_layout, engine.device, 0,
                         engine.grammars, cuda_graphs=spec)
    runner.use_backend(_TritonBackend())
    engine.runner = runner
    graphed_out = run()
    assert runner.graphs is not None and runner.graphs.replays > 0
    for (ref_ids, ref_lp), (ids, lp) in zip(reference_out, graphed_out, strict=True):
        assert ids == ref_ids
        assert lp == pytest.approx(ref_lp, abs=1e-4)
    import conveyor.attention.paged_batch as batching

    def no_host_copy(*args, **kwargs):
        raise AssertionError("a decode-only step copied from the host")

    monkeypatch.setattr(batching, "upload", no_host_copy)
    decodes = AttentionMetadata(torch.arange(3), 3, torch.zeros((3, 2), dtype=torch.int64),
                                torch.tensor([1, 17, 30]), [])
    assert batching.paged_batch(decodes, 16).query_start.tolist() == [0, 1, 2, 3]
