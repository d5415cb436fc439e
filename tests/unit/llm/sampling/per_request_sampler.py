"""The sampler as it was before it was batched (kiln/llm/sampling/sampler.py
up to commit 015c3fa, with its per-row token_counts): one small copy and one
small op per request. Kept only as the reference the batched sampler must
reproduce token for token."""
from __future__ import annotations

import torch

from kiln.llm.request import Request
from kiln.llm.sampling.output import SampledToken
from kiln.llm.sampling.penalties import apply_top_k_top_p_min_p
from kiln.llm.sampling.sampler import needs_processing as _needs_processing


def token_counts(histories: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[N, V] counts of each token id in each history."""
    counts = torch.zeros(len(histories), vocab, device=device)
    for row, ids in enumerate(histories):
        if ids:
            idx = torch.tensor(ids, device=device)
            counts[row].index_add_(0, idx, torch.ones(len(ids), device=device))
    return counts


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Repetition penalty (CTRL / HF convention) over prompt and output;
    presence and frequency penalties (OpenAI convention) over output only."""
    vocab = logits.shape[1]
    out_counts = token_counts(output_ids, vocab, logits.device)
    seen = (token_counts(prompt_ids, vocab, logits.device) + out_counts) > 0
    rep = repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency.unsqueeze(1) * out_counts
    return logits - presence.unsqueeze(1) * (out_counts > 0).float()


class PerRequestSampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        params = [r.sampling_params for r in requests]
        if all(p.greedy and not _needs_processing(p, r) for p, r in zip(params, requests, strict=False)):
            return [SampledToken(int(t)) for t in logits.argmax(dim=-1).tolist()]
        logits = self._process(logits.float(), requests)
        logprobs = logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None
        tokens = self._choose(logits, requests)
        return [self._result(i, t, logprobs, params[i].logprobs) for i, t in enumerate(tokens)]

    # ---- logit processing -------------------------------------------------
    def _process(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
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

    def process(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Logit bias, min_tokens masking and penalties (float32 copy)."""
        return self._process(logits.float(), requests)

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
            seed = req.sampling_params.seed
            if seed is None:
                continue
            gen = self._request_generators.get(req.request_id)
            if gen is None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed)
                self._request_generators[req.request_id] = gen
            race[row].exponential_(generator=gen)
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
