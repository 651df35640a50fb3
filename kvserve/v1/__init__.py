"""Generated gRPC stubs of proto/kvserve/v1 (do not edit; `make proto` regenerates them)."""
