"""The central cache manager: the cluster-wide view of KV blocks, kept in Redis."""
