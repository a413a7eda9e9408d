"""CUDA graphs of decode-only steps (conveyor.runner.cuda_graphs).

On CPU: the bookkeeping a graph replays — the buckets, which steps are eligible, padding to
the bucket, padded rows writing to the scratch block and nowhere else, the static buffers
reused across steps — with the same padded forward pass run eagerly (no graph off CUDA), and
an engine whose runner has graphs against one without. The capture and replay themselves run
in the ``gpu``-marked tests at the end (skipped without CUDA): graph against eager logits,
and a whole generation with and without ``enforce_eager``.
"""

from __future__ import annotations

import gc
import random
from typing import Any

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.attention.metadata import AttentionMetadata, PrefillChunk
from conveyor.config import CacheConfig, ModelConfig
from conveyor.model.llama import build_model
from conveyor.ops import ReferenceBackend, reference
from conveyor.runner.cuda_graphs import (
    SCRATCH_BLOCKS,
    CudaGraphRunner,
    CudaGraphSpec,
    bucket_for,
    graph_batch_sizes,
)
from conveyor.runner.model_runner import KVCacheLayout, ModelRunner, allocate_kv_caches

BLOCK_SIZE = 16  # (an int8 cache needs a multiple of 16)
SHAPE = ModelConfig(architecture="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, qk_norm=True, max_position_embeddings=256)


def test_buckets_are_powers_of_two_to_8_then_multiples_of_8() -> None:
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(3) == (1, 2, 4)
    assert graph_batch_sizes(8) == (1, 2, 4, 8)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 24)  # the last holds max_num_seqs
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    sizes = graph_batch_sizes(20)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 8, 9, 17, 24)] == [1, 4, 8, 8, 16, 24, 24]
    assert bucket_for(25, sizes) is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


def test_graphs_only_on_cuda_and_not_with_enforce_eager() -> None:
    spec = CudaGraphSpec.for_engine(torch.device("cuda"), False, max_num_seqs=20,
                                    max_model_len=100, block_size=16)
    assert spec == CudaGraphSpec((1, 2, 4, 8, 16, 24), max_blocks_per_seq=7)
    assert CudaGraphSpec.for_engine(torch.device("cuda"), True, 20, 100, 16) is None
    assert CudaGraphSpec.for_engine(torch.device("cpu"), False, 20, 100, 16) is None


def _setup(kv_cache_dtype: str, max_num_seqs: int = 8, device: str = "cpu",
           dtype: torch.dtype = torch.float32
           ) -> tuple[Any, torch.Tensor, KVCacheLayout, CudaGraphRunner]:
    """A random-weight model (the torch reference ops, as on CUDA), its cache (with the
    scratch block) holding random K/V in every slot, and a graph runner over it."""
    model = build_model(SHAPE, dtype, torch.device(device), None, seed=3)
    model.use_backend(ReferenceBackend())
    cache = CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=256 << 10,
                        kv_cache_dtype=kv_cache_dtype)
    layout = KVCacheLayout.from_budget(SHAPE, cache, dtype)
    kv_caches, _ = allocate_kv_caches(model, layout, torch.device(device), SCRATCH_BLOCKS)
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange((layout.num_blocks + SCRATCH_BLOCKS) * BLOCK_SIZE, device=device)
    kv_shape = (len(slots), SHAPE.num_key_value_heads, SHAPE.head_dim)
    for layer_cache in kv_caches:
        k, v = (torch.randn(kv_shape, generator=gen).to(device, dtype) for _ in range(2))
        reference.write_kv_(k, v, layer_cache, slots)
    spec = CudaGraphSpec(graph_batch_sizes(max_num_seqs), max_blocks_per_seq=64 // BLOCK_SIZE)
    graphs = CudaGraphRunner(model, kv_caches, spec, layout.num_blocks, BLOCK_SIZE)
    return model, kv_caches, layout, graphs


def _decode_step(n: int, layout: KVCacheLayout, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """n decodes with contexts of 1-60 tokens in distinct random blocks (as the runner lays
    them out: tables [n, the longest's blocks], zero-padded)."""
    rng = random.Random(seed)
    blocks = rng.sample(range(layout.num_blocks), layout.num_blocks)
    lens = [rng.randint(1, 60) for _ in range(n)]
    width = -(-max(lens) // BLOCK_SIZE)
    tables = torch.zeros(n, width, dtype=torch.int64)
    slots = []
    for i, ctx in enumerate(lens):
        own = [blocks.pop() for _ in range(-(-ctx // BLOCK_SIZE))]
        tables[i, :len(own)] = torch.tensor(own)
        slots.append(own[(ctx - 1) // BLOCK_SIZE] * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE)
    ids = torch.tensor([rng.randrange(SHAPE.vocab_size) for _ in range(n)])
    positions = torch.tensor(lens) - 1
    meta = AttentionMetadata(torch.tensor(slots), n, tables, torch.tensor(lens), [])
    return ids, positions, meta


def _check_step(model: Any, kv_caches: torch.Tensor, layout: KVCacheLayout,
                graphs: CudaGraphRunner, n: int, seed: int, tol: float) -> None:
    """One step of n decodes through the graph runner against the model run eagerly on a
    copy of the cache: the same logits, the same K/V in the blocks the step writes, every
    other real block untouched; the scratch block written exactly when the bucket pads."""
    device = kv_caches.device
    ids, positions, meta = _decode_step(n, layout, seed)
    ids, positions = ids.to(device), positions.to(device)
    meta = AttentionMetadata(meta.slot_mapping.to(device), n,
                             meta.decode_block_tables.to(device),
                             meta.decode_context_lens.to(device), [])
    scratch = layout.num_blocks
    kv_caches[:, :, scratch] = 0  # (padded rows write the same K/V at every step)
    eager_cache, before = kv_caches.clone(), kv_caches.clone()
    expected = model.compute_logits(model(ids, positions, eager_cache, meta))
    logits = model.compute_logits(graphs.run(ids, positions, meta))
    torch.testing.assert_close(logits, expected, rtol=tol, atol=tol)
    written = set((meta.slot_mapping // BLOCK_SIZE).tolist())
    for block in range(layout.num_blocks):
        if block not in written:
            assert torch.equal(kv_caches[:, :, block], before[:, :, block]), block
        elif kv_caches.dtype != torch.int8:  # (int8: a scale's bytes are not close)
            torch.testing.assert_close(kv_caches[:, :, block], eager_cache[:, :, block],
                                       rtol=tol, atol=tol)
    padded = bucket_for(n, graphs.spec.batch_sizes) != n
    assert padded == (not torch.equal(kv_caches[:, :, scratch], before[:, :, scratch]))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_padded_step_matches_eager_and_writes_only_real_slots(kv_cache_dtype: str) -> None:
    model, kv_caches, layout, graphs = _setup(kv_cache_dtype)
    graphs.capture()
    with torch.inference_mode():
        for n, seed in ((3, 1), (5, 2), (8, 3), (1, 4)):  # buckets 4, 8, 8, 1
            _check_step(model, kv_caches, layout, graphs, n, seed, tol=1e-5)
    assert graphs.replays == 4


@torch.inference_mode()
def test_static_buffers_are_reused_and_padding_reset() -> None:
    _, _, layout, graphs = _setup("auto")
    graphs.capture()
    buffers = [graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.block_tables,
               graphs.context_lens]
    pointers = [b.data_ptr() for b in buffers]
    graphs.run(*_decode_step(7, layout, seed=5))  # bucket 8: one padded row
    graphs.run(*_decode_step(2, layout, seed=6))  # bucket 2: rows 2-7 keep the last step's
    assert [b.data_ptr() for b in buffers] == pointers
    ids, positions, meta = _decode_step(3, layout, seed=7)  # bucket 4: row 3 is padding
    graphs.run(ids, positions, meta)
    assert graphs.slot_mapping[3] == graphs.scratch_slot == layout.num_blocks * BLOCK_SIZE
    assert graphs.context_lens[3] == 1 and graphs.input_ids[3] == 0
    assert (graphs.block_tables[3] == layout.num_blocks).all()
    assert torch.equal(graphs.slot_mapping[:3], meta.slot_mapping)
    width = meta.decode_block_tables.shape[1]
    assert torch.equal(graphs.block_tables[:3, :width], meta.decode_block_tables)


class _Dead:
    """Cyclic garbage (as a dead engine is) that notes when it is collected."""

    collected_in: list[bool] = []

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        _Dead.collected_in.append(gc.isenabled())


def test_no_collection_runs_inside_the_captures(monkeypatch) -> None:
    """A collection inside a capture would free a dead engine's pinned buffers, whose free
    records an event outside the capture and invalidates it (seen on an H200): garbage is
    collected before the first capture, the collector is off during them, on again after."""
    _, _, _, graphs = _setup("auto")
    during: list[bool] = []
    capture_one = graphs._capture_one

    def watched(size: int) -> Any:
        during.append(gc.isenabled())
        return capture_one(size)

    monkeypatch.setattr(graphs, "_capture_one", watched)
    _Dead.collected_in.clear()
    _Dead()
    graphs.capture()
    assert _Dead.collected_in == [True]  # before the captures
    assert during == [False] * len(graphs.spec.batch_sizes)
    assert gc.isenabled()


def test_only_decode_only_steps_within_the_largest_bucket_are_eligible() -> None:
    _, _, layout, graphs = _setup("auto", max_num_seqs=4)
    assert graphs.spec.batch_sizes == (1, 2, 4)
    _, _, decodes = _decode_step(4, layout, seed=8)
    assert graphs.eligible(decodes)
    _, _, too_many = _decode_step(5, layout, seed=9)
    assert not graphs.eligible(too_many)
    mixed = AttentionMetadata(decodes.slot_mapping, 4, decodes.decode_block_tables,
                              decodes.decode_context_lens, [PrefillChunk(4, 6, 0, None)])
    assert not graphs.eligible(mixed)  # a prefill chunk beside the decodes: eager
    prefill_only = AttentionMetadata(torch.arange(6), 0, None, None,
                                     [PrefillChunk(0, 6, 0, None)])
    assert not graphs.eligible(prefill_only)


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def _generate(llm: LLM, vocab: int) -> list[Any]:
    rng = random.Random(0)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(3, 30))] for _ in range(5)]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)


def test_engine_with_graph_runner_generates_as_eager(tiny_llama_dir: Any, kv_free: Any) -> None:
    """The runner hook: an engine whose runner pads decode-only steps to buckets (here
    eagerly, on CPU) generates the tokens of one that does not."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=1 << 20,
              max_model_len=128, max_num_seqs=8, enable_prefix_caching=False)
    engine = llm.engine
    engine.runner.use_backend(ReferenceBackend())  # the ops CUDA runs
    vocab = engine.model_config.vocab_size
    eager = _generate(llm, vocab)
    spec = CudaGraphSpec(graph_batch_sizes(8), -(-128 // engine.kv_layout.block_size))
    runner = ModelRunner(engine.runner.model, engine.kv_layout, engine.device, 0,
                         engine.grammars, cuda_graphs=spec)
    runner.use_backend(ReferenceBackend())
    assert runner.graphs is not None
    assert runner.kv_caches.shape[2] == engine.kv_layout.num_blocks + SCRATCH_BLOCKS
    engine.runner = runner
    graphed = _generate(llm, vocab)
    assert runner.graphs.replays > 0
    for a, b in zip(eager, graphed, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    kv_free(llm)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_cuda_graph_logits_match_eager(dtype: torch.dtype, kv_cache_dtype: str) -> None:
    model, kv_caches, layout, graphs = _setup(kv_cache_dtype, max_num_seqs=16,
                                              device="cuda", dtype=dtype)
    graphs.capture()
    with torch.inference_mode():
        for n, seed in ((3, 1), (16, 2), (9, 3), (1, 4)):  # buckets 4, 16, 16, 1
            _check_step(model, kv_caches, layout, graphs, n, seed,
                        tol=1e-4 if dtype == torch.float32 else 3e-2)
    assert graphs.replays == 4


@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_with_graphs_generates_as_enforce_eager(tiny_llama_dir: Any,
                                                           kv_free: Any) -> None:
    args: dict[str, Any] = dict(model=str(tiny_llama_dir), device="cuda", dtype="float32",
                                kv_cache_memory=1 << 20, max_model_len=128, max_num_seqs=8)
    graphed = LLM(**args)
    eager = LLM(**args, enforce_eager=True)
    assert graphed.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    vocab = graphed.engine.model_config.vocab_size
    a_out, b_out = _generate(graphed, vocab), _generate(eager, vocab)
    assert graphed.engine.runner.graphs.replays > 0
    for a, b in zip(a_out, b_out, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    kv_free(graphed)
    kv_free(eager)
