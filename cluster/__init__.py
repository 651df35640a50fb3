"""The distributed service: composes the engine (workers), gRPC and, later, Ray Serve."""
