"""`kiln bench serve`: a load generator for OpenAI-compatible servers."""
