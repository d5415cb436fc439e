"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models,
/tokenize, /detokenize."""
