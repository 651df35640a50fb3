"""The distributed service on Ray Serve: replicas that each own one engine (workers), the gRPC
ingress, cache-aware routing, KV reporting to the cache manager, and the local Ray head."""
