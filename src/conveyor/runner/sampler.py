"""Turn one step's logits into one token per sampling request.

Batched where requests agree (greedy rows take an argmax; top-k/top-p/min-p filter the whole
batch with per-row parameters); per-request where they must differ: a seeded request draws
its noise from its own generator, so its samples do not depend on what else is in the batch.
Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)), equivalent to drawing from
p and cheap to batch.

Speculative decoding (``Sampler.verify``): a request with k drafted tokens has k+1 logits
rows; row i is processed exactly as a plain step would process it after the first i drafts
(``SamplingState.after``: penalties and min_tokens see them), so each row's distribution is
the one a plain decode at that position would sample from. Greedy requests take each row's
token as a plain step would and keep the drafts up to the first that differs: the output is
the one speculation off gives. Other requests use the rejection rule of Leviathan et al. /
Chen et al. for deterministic proposals (q(d) = 1): d is kept with probability p(d), a
rejection draws from p without d, after k acceptances one more token comes from the last
row; the output is distributed as the target model's. The draws are the plain sampler's own
(``_rejection``), so a seeded request's tokens do not depend on speculation either.

Logits processors that depend on the tokens so far (the penalties, min_tokens' ban, and any
later per-request mask) belong beside ``_apply_penalties``, which sees one row state per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.core.outputs import Logprob
from conveyor.ops import OpsBackend, ReferenceBackend
from conveyor.ops.transfer import upload
from conveyor.sampling_params import SamplingParams


@dataclass
class SamplingState:
    """What the sampler keeps per request between steps."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # seeded requests only
    eos_token_ids: tuple[int, ...] = ()
    # Outputs sampled by a step whose results are not taken yet (async scheduling): on the
    # device, after output_token_ids
    pending_token_ids: torch.Tensor | None = None
    # Tensors of the request's fixed parameters (allowed ids, biases), uploaded once
    device_tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict,
                                                                repr=False)

    def on_device(self, name: str, values: Iterable[Any], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
        """``values`` on ``device``, uploaded at the first step that needs them and kept for
        the others (the request's parameters do not change)."""
        tensor = self.device_tensors.get(name)
        if tensor is None:
            tensor = self.device_tensors[name] = upload(list(values), device, dtype)
        return tensor

    def after(self, drafts: list[int]) -> SamplingState:
        """This state as it will be once ``drafts`` are accepted (for row i of a verify)."""
        if not drafts:
            return self
        return dataclasses.replace(self, output_token_ids=self.output_token_ids + drafts)

    def with_pending(self, token_ids: torch.Tensor) -> SamplingState:
        """This state with outputs still on the device (a launched step's)."""
        return dataclasses.replace(self, pending_token_ids=token_ids)

    @property
    def num_output_tokens(self) -> int:
        pending = self.pending_token_ids
        return len(self.output_token_ids) + (0 if pending is None else pending.numel())

    def output_ids_on(self, device: torch.device) -> torch.Tensor:
        """Every output token id so far, as a tensor on ``device``."""
        ids = upload(self.output_token_ids, device, torch.long)
        if self.pending_token_ids is None:
            return ids
        return torch.cat([ids, self.pending_token_ids.to(device, torch.long)])

    def banned_token_ids(self) -> list[int]:
        """Tokens masked for the next choice: those that would stop the request before
        min_tokens, and each bad word's last token once the output ends with the tokens
        before it (its only token, always). Bad words read the outputs on the host: the
        runner takes a launched step's result before such a request's next step."""
        banned = [seq[-1] for seq in self.params.bad_words_token_ids
                  if len(seq) == 1 or tuple(self.output_token_ids[1 - len(seq):]) == seq[:-1]]
        if self.num_output_tokens < self.params.min_tokens:
            eos = () if self.params.ignore_eos else self.eos_token_ids
            banned += [*eos, *self.params.stop_token_ids]
        return banned


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.seed is None or params.greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0,
                 backend: OpsBackend | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # The model's ops (greedy rows take its argmax, which reads bf16 logits)
        self.backend: OpsBackend = ReferenceBackend() if backend is None else backend

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]
                 ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """logits: [S, V] in the model's dtype, one row per state -> (token ids, logprobs or
        None each)."""
        return self.sample(logits, states).to_host()

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> Sampled:
        """The tokens sampled on the logits' device, and what ``Sampled.to_host`` brings
        back (the ids, and the logprobs packed with them): nothing waits for the device."""
        if all(_plain_greedy(s) for s in states):
            # The argmax of the logits as computed: a float32 copy would not change it.
            return Sampled(self.backend.argmax(logits), [None] * len(states))
        logits = logits.float()
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in states):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, states)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if random_rows:
            idx = upload(random_rows, logits.device)
            sampled = self._sample(logits.index_select(0, idx), [states[i] for i in random_rows])
            tokens.index_copy_(0, idx, sampled)
        wanted = [s.params.logprobs for s in states]
        if raw_logprobs is None:
            return Sampled(tokens, wanted)
        return Sampled(tokens, wanted, _pack_logprobs(raw_logprobs, tokens, wanted))

    def verify(self, logits: torch.Tensor, states: list[SamplingState],
               drafts: list[list[int]]) -> list[tuple[list[int], list[dict[int, Logprob] | None]]]:
        """logits: len(drafts[i]) + 1 rows per request, in order -> per request the accepted
        drafts plus the token sampled after them, and their logprobs (None each if not
        asked). A request without drafts samples one token, as ``__call__``."""
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + len(d) + 1)
        rejection = [bool(d) and not s.params.greedy for s, d in zip(states, drafts, strict=True)]
        rows = [starts[i] + r for i, d in enumerate(drafts) if not rejection[i]
                for r in range(len(d) + 1)]
        row_states = [states[i].after(d[:r]) for i, d in enumerate(drafts) if not rejection[i]
                      for r in range(len(d) + 1)]
        results: list[tuple[list[int], list[dict[int, Logprob] | None]]] = []
        if rows:
            plain = logits if len(rows) == logits.shape[0] else \
                logits.index_select(0, upload(rows, logits.device))
            tokens, logprobs = self(plain, row_states)
        at = 0
        for i, (state, d) in enumerate(zip(states, drafts, strict=True)):
            if rejection[i]:
                results.append(self._rejection(logits[starts[i]:starts[i + 1]], state, d))
                continue
            row_tokens = tokens[at:at + len(d) + 1]
            kept = next((j for j, t in enumerate(d) if row_tokens[j] != t), len(d))
            results.append((row_tokens[:kept + 1], logprobs[at:at + kept + 1]))
            at += len(d) + 1
        return results

    def _rejection(self, logits: torch.Tensor, state: SamplingState, drafts: list[int]
                   ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """Rejection sampling of one request's drafts (deterministic proposals, q(d) = 1).

        Row i draws its token as a plain step would (the exponential race, one noise draw
        from the request's generator); the draft is kept if the draw equals it, else the
        draw is the token and the run ends. That is the Leviathan/Chen rule for q(d) = 1:
        d is kept with probability p(d) = min(1, p(d)/q(d)), and a rejection's token is
        distributed as max(p - q, 0) renormalized (p without d). One draw per token
        produced, as without drafts: a seeded request gives the same tokens either way.
        """
        views = [state.after(drafts[:i]) for i in range(len(drafts) + 1)]
        logits = logits.float()
        probs = self._probs(self._apply_penalties(logits, views), views)
        generator = state.generator or self.generator
        tokens: list[int] = []
        for i in range(len(drafts) + 1):
            tokens.append(_race(probs[i], generator))
            if i == len(drafts) or tokens[-1] != drafts[i]:
                break
        if state.params.logprobs is None:
            return tokens, [None] * len(tokens)
        raw = torch.log_softmax(logits[:len(tokens)], dim=-1)
        return tokens, [*token_logprobs(raw, upload(tokens, raw.device), state.params.logprobs)]

    def _apply_penalties(self, logits: torch.Tensor,
                         states: list[SamplingState]) -> torch.Tensor:
        """allowed_token_ids, min_tokens' ban on stop tokens, logit_bias, then the
        repetition/presence/frequency penalties (vLLM's order)."""
        banned = [(i, ids) for i, s in enumerate(states) if (ids := s.banned_token_ids())]
        if not banned and not any(s.params.changes_logits for s in states):
            return logits
        logits = logits.clone()
        device = logits.device
        for i, s in enumerate(states):
            if s.params.allowed_token_ids is not None:
                allowed = s.on_device("allowed", s.params.allowed_token_ids, torch.long, device)
                logits[i] = torch.full_like(logits[i], float("-inf")).index_copy_(
                    0, allowed, logits[i].index_select(0, allowed))
        for i, ids in banned:
            logits[i, ids] = float("-inf")
        for i, s in enumerate(states):
            if bias := s.params.logit_bias:
                biased = s.on_device("biased", bias.keys(), torch.long, device)
                values = s.on_device("bias", bias.values(), torch.float32, device)
                logits[i].index_add_(0, biased, values.to(logits.dtype))
        rows = [i for i, s in enumerate(states) if s.params.uses_penalties]
        vocab = logits.shape[-1]
        for i in rows:
            p = states[i].params
            out_ids = states[i].output_ids_on(logits.device)
            row = logits[i]
            if p.repetition_penalty != 1:  # (a mask, not unique(): no wait for the device)
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                seen[upload(states[i].prompt_token_ids, logits.device, torch.long)] = True
                seen[out_ids] = True
                row.copy_(torch.where(seen, torch.where(row > 0, row / p.repetition_penalty,
                                                        row * p.repetition_penalty), row))
            if out_ids.numel() and (p.presence_penalty or p.frequency_penalty):
                # (not bincount: on CUDA it reads the largest id back to size its output)
                counts = torch.zeros(vocab, dtype=row.dtype, device=row.device).index_add_(
                    0, out_ids, torch.ones(out_ids.shape, dtype=row.dtype, device=row.device))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def _sample(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """logits: [R, V] for non-greedy rows -> sampled ids [R]."""
        probs = self._probs(logits, states)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, state in enumerate(states):
            if state.generator is not None:
                noise[i].exponential_(generator=state.generator)
        return (probs / noise).argmax(dim=-1)

    def _probs(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """The distributions the rows sample from: temperature, min-p, top-k, top-p (vLLM's
        order: min-p judges the tempered distribution, top-p what min-p and top-k left)."""
        device = logits.device
        temps = upload([s.params.temperature for s in states], device, torch.float32)
        logits = logits / temps.unsqueeze(1)
        if any(s.params.min_p > 0 for s in states):
            min_p = upload([s.params.min_p for s in states], device, torch.float32)
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if any(s.params.top_k > 0 for s in states):
            logits = _top_k(logits, [s.params.top_k for s in states])
        if any(s.params.top_p < 1 for s in states):
            logits = _top_p(logits, upload([s.params.top_p for s in states], device, torch.float32))
        return torch.softmax(logits, dim=-1)


def _race(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from the (unnormalized) distribution ``probs`` [V]: the exponential race."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def _plain_greedy(state: SamplingState) -> bool:
    p = state.params
    return (p.greedy and p.logprobs is None and not p.changes_logits
            and not state.banned_token_ids())


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = upload([k if k > 0 else vocab for k in ks], logits.device).clamp(max=vocab)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop a token when the mass before it already reaches top_p (the top token always stays).
    drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p.unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class Sampled:
    """One step's sampled tokens on the device, on their way to the host.

    ``tokens`` [S] stay on the device (async scheduling feeds them to the next step there);
    ``start_copy`` starts their copy to host memory (with the logprobs, packed: one copy),
    ``to_host`` waits for it: the step's one device sync."""

    def __init__(self, tokens: torch.Tensor, wanted: list[int | None],
                 packed: torch.Tensor | None = None) -> None:
        self.tokens = tokens
        self.wanted = wanted  # per row: the top n it asks logprobs for, or None
        self._packed = packed  # tokens then each asking row's numbers (_pack_logprobs)
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        data = self._packed if self._packed is not None else self.tokens
        if data.device.type != "cuda":
            return
        self._host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        self._host.copy_(data, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def to_host(self) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """(token ids, per row its logprobs or None)."""
        if self._copied is not None:
            self._copied.synchronize()
        data = self._host if self._host is not None else (
            self._packed if self._packed is not None else self.tokens)
        if self._packed is None:
            return data.tolist(), [None] * len(self.wanted)
        return _unpack_logprobs(data.tolist(), self.wanted)


def token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, top: int
                   ) -> list[dict[int, Logprob]]:
    """Each row's logprob of its token in ``tokens`` (with its rank) and the row's ``top``
    best, in the shape of the sampled tokens' logprobs (a rejection-sampled run's tokens,
    prompt_logprobs)."""
    wanted: list[int | None] = [top] * tokens.numel()
    entries = Sampled(tokens, wanted, _pack_logprobs(logprobs, tokens, wanted)).to_host()[1]
    return [e for e in entries if e is not None]


def _logprob_groups(wanted: list[int | None]) -> dict[int, list[int]]:
    """n -> the rows asking for the top n."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(wanted):
        if n is not None:
            groups.setdefault(n, []).append(i)
    return groups


def _pack_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]
                   ) -> torch.Tensor:
    """The token ids, then for each row that asks (``wanted[i]`` = n; None: no logprobs) the
    sampled token's logprob and rank, the top n logprobs and their ids, as one float64 tensor
    on the logits' device: one copy brings it all to the host (one device sync per step, not
    three per request). Rows asking the same n share one ``topk``, so which of tied values a
    row lists does not depend on the other rows."""
    parts = [tokens.double()]
    for n, rows in _logprob_groups(wanted).items():
        idx = upload(rows, logprobs.device)
        lp = logprobs.index_select(0, idx)
        sampled = lp.gather(1, tokens.index_select(0, idx).unsqueeze(1))
        rank = (lp > sampled).sum(dim=-1, keepdim=True) + 1
        values, ids = lp.topk(n)
        row_parts = [sampled, rank, values, ids]  # per row: 2 + 2n numbers
        parts.append(torch.cat([p.double() for p in row_parts], dim=1).flatten())
    return torch.cat(parts)


def _unpack_logprobs(host: list[float], wanted: list[int | None]
                     ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
    """``_pack_logprobs``'s numbers as token ids and per row its {token: Logprob} or None."""
    groups = _logprob_groups(wanted)
    token_list = [int(t) for t in host[:len(wanted)]]
    result: list[dict[int, Logprob] | None] = [None] * len(wanted)
    at = len(wanted)
    for n, rows in groups.items():
        for i in rows:
            row, at = host[at:at + 2 + 2 * n], at + 2 + 2 * n
            top = {token_list[i]: Logprob(row[0], int(row[1]))}
            for r in range(n):
                top.setdefault(int(row[2 + n + r]), Logprob(row[2 + r], r + 1))
            result[i] = top
    return token_list, result
