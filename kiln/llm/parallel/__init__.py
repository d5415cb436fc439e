"""Tensor and pipeline parallelism: one process per rank, torch.distributed between them.

    layout.py      which heads, rows, vocab slice and layers each rank owns (pure math)
    state.py       process groups and the collectives the model calls
    layers.py      column/row-parallel Linear, vocab-parallel embedding and LM head
    weights.py     read a rank's slices of a checkpoint (lazy for safetensors)
    model.py       a Llama stage holding only its shard
    shard_builder.py  build, load and place a rank's shard; size the sharded KV pool
    plan.py        the typed step plan the driver broadcasts (msgspec bytes)
    stage.py       run one step plan on this rank (micro-batches, p2p, logits)
    worker.py      the loop of a non-driver rank
    executor.py    the driver side: spawns and drives workers, gathers logits
"""
