"""Quality checks of a Kiln model (perplexity), for quantization and other changes to the numerics."""
