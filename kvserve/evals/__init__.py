"""Evaluations: long-context recall under RoPE scaling, and the factual error rate."""
