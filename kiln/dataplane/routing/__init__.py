"""Routes: public names that split traffic among model versions by weight,
with sticky keys, shadow copies and canaries (see docs/operations.md)."""
