"""Tensor parallelism: one model over several ranks, each holding a slice of every weight and
of every KV block (`shard`), talking through one group (`group`). Rank 0 is the engine and
decides everything; the other ranks execute the steps it sends them (`ranks`)."""
