"""Turns a step's logits into one token per sampled request.

Order of operations per row: grammar mask (structured outputs) -> logit
bias -> min_tokens masking -> penalties
-> (logprobs are taken here, from the processed distribution at
temperature 1) -> greedy argmax, or temperature -> top-k/top-p/min-p ->
draw. Draws use the exponential-race trick (argmax p / E, E ~ Exp(1)) so a
seeded request consumes exactly one vocab-sized draw from its own generator
per token, whatever else is in the batch.

Every step is batched: per-request values (biases, banned tokens, histories,
parameters) are gathered on the host and copied once per kind through pinned
memory (sampling/transfer.py), so on CUDA the only host syncs are the final
copies of the chosen tokens (and logprobs) back: none per request. A seeded
request still draws from its own torch.Generator (one launch each, no sync).
"""
from __future__ import annotations

import torch

from kiln.llm.kernels import ops
from kiln.llm.request import Request
from kiln.llm.sampling.output import SampledToken
from kiln.llm.sampling.penalties import apply_penalties, apply_top_k_top_p_min_p
from kiln.llm.sampling.transfer import to_device
from kiln.llm.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from kiln.llm.structured.masks import StepMasks


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum, the first among equals (NaN counts as the
    maximum), as `argmax(dim=-1)`: Kiln's CPU kernel where it applies, else
    through `max`, which gives the same index and on CPU is 4x faster than
    argmax over bf16 rows ([64, 49152]: 1.4 vs 5.9 ms, Zen 4)."""
    indices = ops.row_argmax(logits)
    return logits.max(dim=-1).indices if indices is None else indices


def folded_seed(seed: int) -> int:
    """A 64-bit seed (signed or not) for torch's CPU generator, which keeps only a
    seed's low 32 bits (1, 2**32 + 1 and 2**63 + 1 drew alike): the high half is
    mixed into the low one. Seeds in [0, 2**32) are kept as they are, so their
    samples do not change."""
    if not SEED_MIN <= seed <= SEED_MAX:
        return seed  # not a 64-bit value: torch refuses it, and the request fails alone (engine/core.py)
    value = seed % 2**64
    if value < 2**32:
        return value
    high, low = value >> 32, value & 0xFFFFFFFF
    return (low ^ (high * 0x9E3779B1)) & 0xFFFFFFFF  # Knuth's multiplicative hash spreads the high half


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        # The grammar masks of the step being run (structured outputs), set by the engine core.
        self.constraints: StepMasks | None = None

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def admit(self, request: Request) -> None:
        """Prepare what the request's own parameters need (its seeded
        generator), so a parameter the engine cannot use fails the request
        here, alone, rather than a step of the batch."""
        self.generator_for(request)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        params = [r.sampling_params for r in requests]
        if all(p.greedy and not needs_processing(p, r) for p, r in zip(params, requests, strict=False)):
            return [SampledToken(int(t)) for t in row_argmax(logits).tolist()]
        logits = self.process(logits, requests)
        logprobs = logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None
        tokens = self._choose(logits, requests)
        return self._results(tokens, logprobs, params)

    # ---- logit processing -------------------------------------------------
    def process(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Grammar masks, logit bias, min_tokens masking and penalties (on a
        float32 copy when `logits` is not float32; callers that need the
        input kept pass a clone)."""
        logits = logits.float()
        if self.constraints is not None and any(r.sampling_params.structured is not None for r in requests):
            self.constraints.apply(logits, requests)
        vocab = logits.shape[1]
        bias = [(row, t, b) for row, r in enumerate(requests)
                for t, b in r.sampling_params.logit_bias.items() if 0 <= t < vocab]
        if bias:
            at = to_device([(row, t) for row, t, _ in bias], torch.long, self.device)
            logits.index_put_((at[:, 0], at[:, 1]), to_device([b for *_, b in bias], logits.dtype, self.device),
                              accumulate=True)
        banned = [(row, t) for row, r in enumerate(requests) for t in _banned_for_now(r, vocab)]
        if banned:
            at = to_device(banned, torch.long, self.device)
            logits.index_put_((at[:, 0], at[:, 1]), torch.full((), float("-inf"), device=self.device))
        if any(r.sampling_params.needs_penalties for r in requests):
            rep, presence, frequency = self._columns(
                requests, ("repetition_penalty", "presence_penalty", "frequency_penalty")
            )
            logits = apply_penalties(
                logits, [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests],
                rep, presence, frequency,
            )
        return logits

    def _columns(self, requests: list[Request], names: tuple[str, ...]) -> torch.Tensor:
        """[len(names), N] float32 parameter columns, in one copy."""
        values = [[float(getattr(r.sampling_params, n)) for r in requests] for n in names]
        return to_device(values, torch.float32, self.device)

    # ---- choosing ------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        tokens = row_argmax(logits)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if not random_rows:
            return tokens
        sub = [requests[i] for i in random_rows]
        if len(random_rows) == len(requests):
            probs = self.warp(logits, sub)
            return row_argmax(probs / self._exponentials(probs, sub))
        rows = to_device(random_rows, torch.long, self.device)
        probs = self.warp(logits[rows], sub)
        tokens[rows] = row_argmax(probs / self._exponentials(probs, sub))
        return tokens

    def warp(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Processed logits of non-greedy rows -> the distribution they are
        drawn from (temperature, then top-k/top-p/min-p; the vocabulary sort
        is skipped when no row asks for any of the three)."""
        params = [r.sampling_params for r in requests]
        # A top_k beyond the vocabulary keeps all of it: clamped on the host,
        # it is exact in float32 (vocabularies are far below 2**24) and fits
        # the device's integer type whatever the request asked.
        vocab = logits.shape[1]
        columns = [[float(p.temperature) for p in params], [float(min(p.top_k, vocab)) for p in params],
                   [float(p.top_p) for p in params], [float(p.min_p) for p in params]]
        temperature, top_k, top_p, min_p = to_device(columns, torch.float32, self.device)
        scaled = logits / temperature.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            scaled = apply_top_k_top_p_min_p(scaled, top_k.long(), top_p, min_p)
        return scaled.softmax(dim=-1)

    def generator_for(self, request: Request) -> torch.Generator:
        """The request's own seeded generator, or the shared one."""
        seed = request.sampling_params.seed
        if seed is None:
            return self.generator
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(folded_seed(seed) if self.device.type == "cpu" else seed)
            self._request_generators[request.request_id] = gen
        return gen

    def _exponentials(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        race = torch.empty_like(probs)
        race.exponential_(generator=self.generator)
        for row, req in enumerate(requests):
            if req.sampling_params.seed is not None:
                race[row].exponential_(generator=self.generator_for(req))
        return race

    @staticmethod
    def _results(tokens: torch.Tensor, logprobs: torch.Tensor | None, params) -> list[SampledToken]:
        """Tokens (and logprobs) to the host in one copy."""
        if logprobs is None:
            return [SampledToken(int(t)) for t in tokens.tolist()]
        n_top = max((p.logprobs for p in params if p.logprobs is not None), default=0)
        parts = [tokens.unsqueeze(1).double(), logprobs.gather(1, tokens.unsqueeze(1)).double()]
        if n_top:
            values, ids = logprobs.topk(n_top, dim=-1)
            parts += [ids.double(), values.double()]
        host = torch.cat(parts, dim=1).tolist()
        out = []
        for row, p in zip(host, params, strict=True):
            token = int(row[0])
            if p.logprobs is None:
                out.append(SampledToken(token))
                continue
            ids, values = row[2 : 2 + p.logprobs], row[2 + n_top : 2 + n_top + p.logprobs]
            out.append(SampledToken(token, row[1], [(int(i), v) for i, v in zip(ids, values, strict=True)]))
        return out


def _banned_for_now(req: Request, vocab: int) -> list[int]:
    """Tokens masked while the request is below its min_tokens."""
    p = req.sampling_params
    if req.num_output_tokens >= p.min_tokens:
        return []
    ids = p.stop_token_ids if p.ignore_eos else (*req.eos_token_ids, *p.stop_token_ids)
    return [t for t in ids if t < vocab]


def needs_processing(p: SamplingParams, req: Request) -> bool:
    return (
        p.needs_processing_always or p.needs_penalties or p.logprobs is not None
        or req.num_output_tokens < p.min_tokens
    )
