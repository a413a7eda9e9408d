"""The token bitmasks of a step's constrained rows: filled by llguidance's executor in batched
calls (in a worker thread, while the forward pass runs), applied to the logits before
sampling. Rows without a constraint are neither read nor written, so a batch that mixes
constrained and free requests pays only for the constrained ones.

A constrained request verifying drafts has one mask per row: row i is the mask after its
first i drafts. llguidance computes them in one call (``..._with_draft_tokens``: mask, then
consume the next draft, ..., rolled back at the end), stopping at a draft the grammar
refuses: the rows after it keep "all allowed", and are never reached, as the refused draft
cannot be sampled from its masked row, so the verify rejects it there.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from conveyor.ops import cpu_kernels

logger = logging.getLogger(__name__)

BITS = 32  # tokens per int32 word of the bitmask


class BitmaskFiller:
    """Fills the next-token masks of a step's constrained requests off the calling thread."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.num_words = -(-vocab_size // BITS)
        self.eos_token_ids = eos_token_ids
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")

    def start(self, matchers: list[llguidance.LLMatcher], drafts: list[list[int]]
              ) -> Future[torch.Tensor]:
        """Begin filling the masks of each matcher's rows (1 + its drafts); the
        [sum(rows), num_words] int32 result when needed."""
        return self._thread.submit(self.fill, matchers, drafts)

    def fill(self, matchers: list[llguidance.LLMatcher], drafts: list[list[int]]
             ) -> torch.Tensor:
        offsets = np.cumsum([0] + [len(d) + 1 for d in drafts]).tolist()
        # numpy only on this thread: a torch op large enough to run in parallel would start
        # a second OpenMP team beside the step loop's, and with more OpenMP threads than
        # cores libgomp stops spinning between parallel regions, so every later kernel call
        # of the step loop waits for its workers to wake (free requests ran 1.7x slower
        # after 64 constrained ones on 2 cores).
        bitmask = np.full((offsets[-1], self.num_words), -1, dtype=np.int32)
        # llguidance's numpy entry point (its torch module would import torch._dynamo, ~4 s,
        # for a torch.compile this engine does not use).
        firsts = list(zip(matchers, offsets, drafts, strict=False))  # (offsets: one more)
        plain = [(m, first) for m, first, d in firsts if not d]
        drafted = [(m, first, d) for m, first, d in firsts if d]
        if plain:
            llg_numpy.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:
            llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted,
                                                                     bitmask)
        words = bitmask.view(np.uint32)
        for i, m in enumerate(matchers):
            if m.is_error():  # llguidance ran out of fuel or was fed a token it refused:
                logger.warning("grammar matcher failed, ending its request: %s",
                               m.get_error())
                # EOS only, a placeholder: the runner reports the error and the engine ends
                # the request with finish_reason "error", dropping the token
                rows = words[offsets[i]:offsets[i + 1]]
                rows[:] = 0
                for t in self.eos_token_ids:
                    rows[:, t // BITS] |= np.uint32(1 << (t % BITS))
        return torch.from_numpy(bitmask)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    logits: [S, V] (V may exceed the tokenizer's vocabulary: padding tokens are disallowed);
    bitmask: [len(rows), W] int32 on the host, bit t % 32 of word t // 32 set = token t allowed.
    On the host: the C++ kernel (~1 us a row), else numpy (single-threaded, ~25 us a row):
    torch's parallel element-wise ops on a busy machine cost tens of ms for these small
    tensors.
    """
    if (logits.device.type == "cpu" and logits.is_contiguous()
            and cpu_kernels.load_cpu_kernels()):
        cpu_kernels.apply_token_bitmask_(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
        return
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    banned = np.ones((len(rows), vocab), dtype=bool)
    width = min(vocab, bits.shape[1])
    banned[:, :width] = bits[:, :width] == 0
    if logits.device.type != "cpu" or not logits.is_contiguous():
        index = torch.tensor(rows, device=logits.device)
        masked = logits.index_select(0, index).masked_fill_(
            torch.from_numpy(banned).to(logits.device), float("-inf"))
        logits.index_copy_(0, index, masked)
        return
    # The same bytes as integers (numpy has no bfloat16), -inf as its bit pattern.
    as_int = logits.view(_SAME_SIZE_INT[logits.element_size()])
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype).view(as_int.dtype).item()
    values = as_int.numpy()
    for j, row in enumerate(rows):
        values[row][banned[j]] = neg_inf


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
