"""Benchmark tooling: seeded prefix-heavy workloads, an OpenAI-API load client, and the comparison runner."""
