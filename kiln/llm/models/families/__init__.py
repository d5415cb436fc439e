"""One module per model family, each defining `FAMILY` (kiln.llm.models.registry.Family)."""
