"""Exceptions raised by the cache and its allocators: misuse is reported, never silently absorbed."""

from __future__ import annotations


class KVCacheError(RuntimeError):
    """Base class of every error raised by radix/."""


class KVOutOfMemoryError(KVCacheError):
    """More KV slots (or request rows) were asked for than are free."""


class DoubleFreeError(KVCacheError):
    """A page or request slot was freed twice."""


class UnownedSlotError(KVCacheError):
    """A slot outside the pool (or on the reserved page) was freed."""


class IntegrityError(KVCacheError):
    """The accounting invariant free + evictable + protected + private == capacity does not hold."""
