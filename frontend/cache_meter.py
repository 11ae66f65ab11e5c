"""CacheMeter: the prefix-cache hit rate of the server behind a backend, over a span of work.

It reads the server's cumulative counters (``/get_server_info`` -> ``cache.hit_tokens`` /
``miss_tokens``) at the start and on demand, and reports the difference, so no cache flush is needed
and earlier traffic does not blur the figure. Backends without those counters (OpenAI) give ``None``.
"""

from __future__ import annotations

from typing import Any


class CacheMeter:
    def __init__(self, backend: Any = None):
        from frontend.run import resolve_backend

        self.backend = resolve_backend(backend)
        self._start = self._counters()

    def _counters(self) -> tuple[int, int] | None:
        try:
            cache = self.backend.get_server_info().get("cache") or {}
        except Exception:  # a server without the endpoint: no figure, not a failure
            return None
        if "hit_tokens" not in cache:
            return None
        return int(cache["hit_tokens"]), int(cache["miss_tokens"])

    def stats(self) -> dict[str, Any]:
        """``{"hit_tokens", "miss_tokens", "hit_rate"}`` since the meter was made (values None if unknown)."""
        now = self._counters()
        if now is None or self._start is None:
            return {"hit_tokens": None, "miss_tokens": None, "hit_rate": None}
        hit, miss = now[0] - self._start[0], now[1] - self._start[1]
        return {"hit_tokens": hit, "miss_tokens": miss, "hit_rate": hit / (hit + miss) if hit + miss else 0.0}

    def hit_rate(self) -> float | None:
        rate = self.stats()["hit_rate"]
        return None if rate is None else float(rate)

    def summary(self) -> str:
        s = self.stats()
        if s["hit_rate"] is None:
            return "cache hit rate: not reported by this backend"
        return (f"cache hit rate: {100 * s['hit_rate']:.1f}% "
                f"({s['hit_tokens']} of {s['hit_tokens'] + s['miss_tokens']} prompt tokens from the cache)")
