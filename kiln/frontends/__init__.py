"""HTTP frontends: the OpenAI-compatible API and operations endpoints."""
