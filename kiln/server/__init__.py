"""The composition root: builds the whole server process (data plane, HTTP app
with every route, gRPC) and runs it. `kiln serve` is its only entry point."""
