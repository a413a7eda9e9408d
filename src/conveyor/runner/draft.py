"""Speculative decoding with a draft model (``method: draft_model``). Layer 2.

A smaller model with the target's vocabulary proposes the tokens the target verifies. It is
loaded as the target is (GGUF or HF folder, the engine's dtype and device) and keeps its own
paged K/V, a second set of tensors shaped for its layers and heads, under the *same* block
tables: a slot is the same ``block_id * block_size + offset`` in both caches, so the
scheduler's allocation, trimming of rejected slots, preemption (swap copies both caches) and
frees serve both at once.

The draft model runs only for requests that draft this step, and catches up lazily: per
request it remembers how many leading positions of its K/V are valid (``computed``), and
before drafting it computes the positions from there to the request's last verified token as
one chunk. A step where nobody drafts (the scheduler's cost model turned speculation off, or
no request wants drafts) runs no draft pass at all, and a request that stops drafting costs
nothing until it drafts again. Each drafting step, before the target's forward pass:

1. one batched pass computes each verify's catch-up chunk (often one or two tokens: the
   previous verify's last accepted draft and the token sampled after it; a whole prompt the
   first time), writing its K/V; the chunk's last row gives the first draft (greedy: argmax
   of the draft model's logits);
2. one batched decode pass per further draft position (for the verifies that want that
   many), each writing the K/V of the draft it reads.

After the target's verify, the positions up to the last *accepted* draft the draft model
read stay valid; the rest (rejected drafts, and the token sampled after them) are computed by
the next catch-up. A request the runner gets again in ``new_requests`` (new, or resumed after
preemption) starts from nothing: its blocks may be new, or prefix-cache hits whose draft K/V
no one computed. The draft K/V never affects outputs, only how many drafts are accepted:
the target verifies every draft.

Drafts are greedy and ignore the request's sampling parameters (penalties, temperature):
they are deterministic proposals, which ``Sampler.verify`` accepts exactly as n-gram drafts
(greedy: kept while equal to the target's token; sampled: the Leviathan/Chen rule for a
draft with q(d) = 1), so the outputs are those of speculation off either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from conveyor.attention.metadata import AttentionMetadata
from conveyor.config import EngineArgs, ModelConfig, SpeculativeConfig
from conveyor.core.outputs import ModelRunnerOutput, ScheduledRequest
from conveyor.model.llama import CausalLM, load_model
from conveyor.model.loader import load_checkpoint
from conveyor.runner.model_runner import KVCacheLayout, allocate_kv_caches
from conveyor.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# ModelRunner._prepare: a decodes-first batch -> (input ids, positions, attention metadata)
PrepareFn = Callable[[list[ScheduledRequest]],
                     tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]


def load_draft_model(spec: SpeculativeConfig | None, args: EngineArgs, target: ModelConfig,
                     tokenizer: Tokenizer | None, dtype: torch.dtype, device: torch.device,
                     max_model_len: int) -> CausalLM | None:
    """The draft model of ``spec`` (None unless its method is draft_model), loaded as the
    target is. ValueError naming speculative_config.model when it cannot serve as the
    target's draft (another vocabulary, a shorter context)."""
    if spec is None or spec.method != "draft_model":
        return None
    load_format = "dummy" if args.load_format == "dummy" else "auto"
    try:
        checkpoint = load_checkpoint(spec.model, load_format)
    except FileNotFoundError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    config = checkpoint.config
    _check_vocabulary(config, checkpoint.tokenizer, target, tokenizer, spec.model)
    if config.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model {spec.model!r} has a context of "
                         f"{config.max_position_embeddings} positions, less than max_model_len="
                         f"{max_model_len}")
    model = load_model(checkpoint, args, device, dtype)  # as the target's (dummy too)
    logger.info("draft model %s: %d layers, %d KV heads x %d, %.1fM parameters",
                checkpoint.path, config.num_hidden_layers, config.num_key_value_heads,
                config.head_dim, config.num_parameters() / 1e6)
    return model


def _check_vocabulary(draft: ModelConfig, draft_tokenizer: Tokenizer | None,
                      target: ModelConfig, target_tokenizer: Tokenizer | None,
                      path: str | None) -> None:
    """A draft's token ids must mean the target's tokens: the same vocabulary size and, where
    both have a tokenizer, the same token -> id map."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {path!r} has a vocabulary of "
                         f"{draft.vocab_size} tokens, the target model {target.vocab_size}: "
                         "a draft model must share the target's tokenizer")
    if draft_tokenizer is not None and target_tokenizer is not None \
            and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"speculative_config.model {path!r} has another tokenizer than the "
                         "target model (the same ids name different tokens): a draft model "
                         "must share the target's tokenizer")


class DraftModelProposer:
    """The draft model over its own paged K/V (same blocks as the target's), proposing each
    verify's drafts at the start of the step (see the module docstring)."""

    def __init__(self, model: CausalLM, layout: KVCacheLayout, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.block_size = layout.block_size
        # [draft layers, 2, blocks, block_size, draft KVH, draft D], blocks as the target's
        self.kv_caches, self.swap_space = allocate_kv_caches(model, layout, device)
        # request id -> leading positions whose draft K/V is valid
        self.computed: dict[str, int] = {}
        self.proposed: set[str] = set()  # the verifies whose drafts it proposed this step

    def forget(self, request_id: str) -> None:
        """A request finished, or (re)joined: its draft K/V is to be computed anew."""
        self.computed.pop(request_id, None)

    def propose(self, batch: list[ScheduledRequest], prepare: PrepareFn
                ) -> list[ScheduledRequest]:
        """Draft each verify's ``num_spec_tokens`` tokens (catching the draft K/V up
        first); ``batch`` with ``spec_token_ids`` set. No draft pass when nothing drafts."""
        # (A verify whose drafts are set already carries the tokens its grammar forces.)
        verifies = [s for s in batch if s.num_spec_tokens and not s.spec_token_ids]
        self.proposed = {s.request_id for s in verifies}
        if not verifies:
            return batch
        # Each verify's catch-up chunk: its valid draft K/V up to its last verified token (a
        # one-token chunk is a decode: those first, as the runner lays a batch out).
        chunks = sorted((replace(s, num_computed_tokens=(start := min(
            self.computed.get(s.request_id, 0), s.num_computed_tokens)),
            num_new_tokens=s.num_computed_tokens + 1 - start, num_spec_tokens=0)
            for s in verifies), key=lambda c: c.num_new_tokens > 1)
        input_ids, positions, meta = prepare(chunks)
        last_rows = torch.tensor(np.cumsum([c.num_new_tokens for c in chunks]) - 1,
                                 device=self.device)  # all rows when every chunk is a decode
        keep = last_rows if len(chunks) < len(input_ids) else None
        hidden = self.model.step(input_ids, positions, self.kv_caches, meta, keep)
        drafts = {c.request_id: [t] for c, t in zip(chunks, self._greedy(hidden), strict=True)}
        for offset in range(1, max(s.num_spec_tokens for s in verifies)):
            rows = [s for s in verifies if s.num_spec_tokens > offset]
            hidden = self._decode(rows, [drafts[s.request_id][-1] for s in rows],
                                  [s.num_computed_tokens + offset for s in rows])
            for s, token in zip(rows, self._greedy(hidden), strict=True):
                drafts[s.request_id].append(token)
        return [replace(s, spec_token_ids=drafts[s.request_id]) if s.request_id in drafts
                else s for s in batch]

    def record(self, samplers: list[ScheduledRequest], output: ModelRunnerOutput) -> None:
        """After the target's verify: each verify's draft K/V is valid through its last
        verified token and the accepted drafts the draft model read (all but its last).
        Drafts it did not propose (forced by a grammar) it has not read: its K/V catches
        up on them at the request's next draft."""
        for s in samplers:
            if s.request_id in self.proposed and (
                    tokens := output.sampled_token_ids.get(s.request_id)):
                accepted = min(len(tokens) - 1, s.num_spec_tokens - 1)
                self.computed[s.request_id] = s.num_computed_tokens + 1 + accepted

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        """hidden: [R, hidden] -> the draft model's top token of each row."""
        tokens: list[int] = self.model.compute_logits(hidden).argmax(-1).tolist()
        return tokens

    def _decode(self, rows: list[ScheduledRequest], tokens: list[int], positions: list[int]
                ) -> torch.Tensor:
        """One decode pass of the draft model: ``tokens[i]`` at ``positions[i]`` of
        ``rows[i]`` (within its block table), its K/V written to its slot, attending to the
        positions before; -> hidden [len(rows), hidden]."""
        bs = self.block_size
        pos = np.array(positions, dtype=np.int64)
        max_blocks = int(pos.max()) // bs + 1
        tables = np.zeros((len(rows), max_blocks), dtype=np.int64)  # padding -> block 0
        for i, s in enumerate(rows):
            n = min(len(s.block_ids), max_blocks)
            tables[i, :n] = s.block_ids[:n]
        slots = tables[np.arange(len(rows)), pos // bs] * bs + pos % bs
        pos_t = torch.from_numpy(pos).to(self.device)
        meta = AttentionMetadata(torch.from_numpy(slots).to(self.device), len(rows),
                                 torch.from_numpy(tables).to(self.device), pos_t + 1, [])
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.model.step(input_ids, pos_t, self.kv_caches, meta)
