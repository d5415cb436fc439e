"""Turns a step's logits into one token per sampled request.

Order of operations per row: logit bias -> min_tokens masking -> penalties
-> (logprobs are taken here, from the processed distribution at
temperature 1) -> greedy argmax, or temperature -> top-k/top-p/min-p ->
draw. Draws use the exponential-race trick (argmax p / E, E ~ Exp(1)) so a
seeded request consumes exactly one vocab-sized draw from its own generator
per token, whatever else is in the batch.
"""
from __future__ import annotations

import torch

from kiln.llm.request import Request
from kiln.llm.sampling.output import SampledToken
from kiln.llm.sampling.penalties import apply_penalties, apply_top_k_top_p_min_p
from kiln.llm.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        params = [r.sampling_params for r in requests]
        if all(p.greedy and not needs_processing(p, r) for p, r in zip(params, requests, strict=False)):
            return [SampledToken(int(t)) for t in logits.argmax(dim=-1).tolist()]
        logits = self.process(logits, requests)
        logprobs = logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None
        tokens = self._choose(logits, requests)
        return [self._result(i, t, logprobs, params[i].logprobs) for i, t in enumerate(tokens)]

    # ---- logit processing -------------------------------------------------
    def process(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Logit bias, min_tokens masking and penalties (on a float32 copy
        when `logits` is not float32; callers that need the input kept pass
        a clone)."""
        logits = logits.float()
        for row, req in enumerate(requests):
            p = req.sampling_params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if 0 <= t < logits.shape[1]], dtype=torch.long)
                vals = torch.tensor([p.logit_bias[t] for t in ids.tolist()], dtype=logits.dtype)
                logits[row].index_add_(0, ids.to(logits.device), vals.to(logits.device))
            if req.num_output_tokens < p.min_tokens:
                banned = [t for t in (*req.eos_token_ids, *p.stop_token_ids) if t < logits.shape[1]]
                if p.ignore_eos:
                    banned = [t for t in p.stop_token_ids if t < logits.shape[1]]
                logits[row, banned] = float("-inf")
        if any(r.sampling_params.needs_penalties for r in requests):
            logits = apply_penalties(
                logits,
                [r.prompt_token_ids for r in requests],
                [r.output_token_ids for r in requests],
                self._column(requests, "repetition_penalty"),
                self._column(requests, "presence_penalty"),
                self._column(requests, "frequency_penalty"),
            )
        return logits

    def _column(self, requests: list[Request], name: str) -> torch.Tensor:
        return torch.tensor([getattr(r.sampling_params, name) for r in requests], device=self.device)

    # ---- choosing ------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=self.device)
            sub = [requests[i] for i in random_rows]
            probs = self.warp(logits[rows], sub)
            race = self._exponentials(probs, sub)
            tokens[rows] = (probs / race).argmax(dim=-1)
        return tokens.tolist()

    def warp(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Processed logits of non-greedy rows -> the distribution they are
        drawn from (temperature, then top-k/top-p/min-p)."""
        scaled = logits / self._column(requests, "temperature").unsqueeze(1)
        scaled = apply_top_k_top_p_min_p(
            scaled,
            self._column(requests, "top_k").long(),
            self._column(requests, "top_p"),
            self._column(requests, "min_p"),
        )
        return scaled.softmax(dim=-1)

    def generator_for(self, request: Request) -> torch.Generator:
        """The request's own seeded generator, or the shared one."""
        seed = request.sampling_params.seed
        if seed is None:
            return self.generator
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
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
    def _result(row: int, token: int, logprobs: torch.Tensor | None, n_top: int | None) -> SampledToken:
        if logprobs is None or n_top is None:
            return SampledToken(token)
        lp = logprobs[row]
        top = []
        if n_top > 0:
            values, ids = lp.topk(n_top)
            top = list(zip(ids.tolist(), values.tolist(), strict=False))
        return SampledToken(token, float(lp[token]), top)


def needs_processing(p: SamplingParams, req: Request) -> bool:
    """Whether the row needs more than a plain argmax or draw (bias, penalties, logprobs, min_tokens)."""
    return bool(p.logit_bias) or p.needs_penalties or p.logprobs is not None or req.num_output_tokens < p.min_tokens

