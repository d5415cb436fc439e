"""Token-level stop conditions, checked in the engine core after sampling.

Stop *strings* need text and are checked by the detokenizing side, which
aborts the request in the core.
"""
from __future__ import annotations

from kiln.llm.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    params = request.sampling_params
    n_out = request.num_output_tokens
    if n_out >= params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
    if n_out >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def prefill_only_status(request: Request) -> RequestStatus:
    """How a prefill-only request ends once its prompt is done: prompt scoring
    (max_tokens 0) has reached its max_tokens, so `length` (as vLLM and OpenAI
    answer echo with max_tokens 0); an embedding simply stops."""
    return RequestStatus.FINISHED_STOPPED if request.pooling is not None else RequestStatus.FINISHED_LENGTH
