"""Tensor-parallel communication: the collectives the sharded model calls (``comm``)."""
