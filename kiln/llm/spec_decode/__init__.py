"""Speculative decoding: cheap proposers guess k tokens, the target model
verifies them in one forward, and rejection sampling keeps the output
distribution exactly the target's.

    proposer.py   the Proposer interface and who gets drafts this step
    ngram.py      prompt lookup (n-gram matching over prompt + output)
    draft_model.py a smaller model with its own paged KV cache
    rejection.py  greedy acceptance and rejection sampling
    verify.py     runner side: logits of 1 + k rows -> verified tokens
"""
