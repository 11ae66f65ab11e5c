"""Benchmark tooling: the shared workloads, an OpenAI-API load client, and the comparison runner."""
