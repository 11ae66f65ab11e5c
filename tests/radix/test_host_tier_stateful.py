"""The radix-cache state machine over HierarchicalRadixCache, with real K/V tensors in both tiers.

The reference of ``test_radix_stateful`` keeps modelling the *device* tier (a device eviction, which may
move a node to the host, is still checked to take the least recently used unlocked device leaf). On top:
every slot's K/V encodes the prefix whose KV it is, so a load back is checked bit for bit against what
was computed; every host drop (seen through the ``LowerTier`` hook) is checked to be a host-only leaf whose
host K/V is its own, taken least recently used first; and ``check_integrity`` checks both tiers' books
after every step.
"""

from __future__ import annotations

from array import array

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import rule

from radix import KVOutOfMemoryError, KVShape, KVStorage, PagedAllocator, PrefixCache, ReqToTokenPool
from radix.hierarchical_cache import HierarchicalRadixCache, TieredNode
from radix.host_pool import HostKVPool
from tests.radix.test_radix_stateful import CacheMachine

HOST_PAGES = 24
SHAPE = KVShape(num_layers=2, num_kv_heads=1, head_dim=2)


class DropChecker:
    """The lower tier: checks each block the host pool drops."""

    def __init__(self, machine: HostTierMachine):
        self.machine = machine

    def on_host_evict(self, node: TieredNode, block_hashes, host_slots: torch.Tensor, pool: HostKVPool) -> None:
        self.machine.check_host_drop(node, host_slots, pool)


class HostTierMachine(CacheMachine):
    write_policy = "write_through"
    pool_cls = HostKVPool

    def make_cache(self, alloc: PagedAllocator, pool: ReqToTokenPool) -> PrefixCache:
        self.kv = KVStorage(SHAPE, alloc.total_slots, self.page_size)
        self.host = self.pool_cls(SHAPE, HOST_PAGES * self.page_size, self.page_size)
        self.codes: dict[tuple, int] = {}
        self.decode: list[tuple] = [()]
        self.loads = self.drops = 0
        self.history: list[tuple] = []
        return HierarchicalRadixCache(alloc, pool, self.kv, self.host, self.write_policy, lower_tier=DropChecker(self))

    # ------------------------------------------------------------------ KV contents
    def code(self, prefix: tuple) -> int:
        if prefix not in self.codes:
            self.codes[prefix] = len(self.decode)
            self.decode.append(prefix)
        return self.codes[prefix]

    def expected_kv(self, ns, tokens, start, n) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.tensor([float(self.code((ns, tuple(tokens[: i + 1])))) for i in range(start, start + n)])
        k = torch.stack([torch.stack([codes, torch.full_like(codes, layer)], -1) for layer in range(SHAPE.num_layers)])
        return k[:, :, None, :], -k[:, :, None, :]  # [layers, n, heads=1, dim=2]

    def write_content(self, st, ns, tokens, start):
        super().write_content(st, ns, tokens, start)
        slots = self.cache.req_to_token.read(st.row, start, len(tokens))
        k, v = self.expected_kv(ns, tokens, start, len(tokens) - start)
        self.kv.k_buffer[:, slots] = k
        self.kv.v_buffer[:, slots] = v

    # ------------------------------------------------------------------ host tier checks
    def load_host(self, m, ns, tokens, expect):
        if not m.host_len:
            return m, expect
        host_len = m.host_len
        self.touch(ns, tokens, expect)  # the match touched the device part before load_back evicts
        try:
            lb = self.cache.load_back(m)
        except KVOutOfMemoryError:
            self.absorb_frees()
            assert self.alloc.free_size < host_len  # only the matched prefix itself was left to evict
            return m, expect
        self.absorb_frees()
        lb.handle.wait()
        assert lb.match.length == expect + host_len
        k, v = self.expected_kv(ns, tokens, expect, host_len)
        assert torch.equal(self.kv.k_buffer[:, lb.slots], k), "loaded K differs from the computed K"
        assert torch.equal(self.kv.v_buffer[:, lb.slots], v), "loaded V differs from the computed V"
        slots = lb.slots.tolist()
        for i, s in enumerate(slots, expect):
            self.content[s] = (ns, tuple(tokens[: i + 1]))
        ps = self.page_size
        for end in range(expect + ps, expect + host_len + 1, ps):
            self.cached[(ns, tuple(tokens[:end]))] = slots[end - expect - 1]
        self.loads += 1
        return lb.match, expect + host_len

    def check_host_drop(self, node: TieredNode, host_slots: torch.Tensor, pool: HostKVPool) -> None:
        assert node.tier == "host" and not node.children and node.lock_ref == 0, "dropped a non host-only leaf"
        codes = pool.k_buffer[0, host_slots, 0, 0].tolist()
        prefixes = [self.decode[int(c)][1] for c in codes]
        assert [p[-1] for p in prefixes] == array("i", node.key).tolist(), "host KV is not the node's own"
        assert all(len(b) == len(a) + 1 and b[:-1] == a for a, b in zip(prefixes, prefixes[1:], strict=False))
        cache = self.cache
        assert isinstance(cache, HierarchicalRadixCache)
        assert all(n.last_access >= node.last_access for n in cache.host_eviction_order()), "host drop not LRU"
        self.drops += 1

    def record_insert(self, ns, tokens, n):
        super().record_insert(ns, tokens, n)
        self.history.append((ns, list(tokens[:n])))

    @rule(i=st.integers(0, 63), extra=st.lists(st.integers(0, 2), max_size=6))
    def revisit(self, i, extra):
        """A prompt cached earlier comes back (a multi-turn conversation): the likeliest host hit."""
        if self.history:
            ns, tokens = self.history[i % len(self.history)]
            self.start_request(ns, tokens + extra)

    @rule(n=st.integers(1, 3 * 16))
    def evict_host(self, n):
        cache = self.cache
        assert isinstance(cache, HierarchicalRadixCache)
        free = cache.evict_host(n * self.page_size)
        assert free >= n * self.page_size or not cache.host_eviction_order()


def make_case(ps: int, policy: str):
    cls = type(f"HostTierPs{ps}{policy}", (HostTierMachine,), {"page_size": ps, "write_policy": policy})
    case = cls.TestCase
    case.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
    return case


TestWriteThroughPs1 = make_case(1, "write_through")
TestWriteBackPs1 = make_case(1, "write_back")
TestWriteThroughPs4 = make_case(4, "write_through")
TestWriteBackPs4 = make_case(4, "write_back")


class CorruptingPool(HostKVPool):
    """Restores one value wrong: the machine must notice."""

    def restore(self, host_slots, storage, device_slots):
        handle = super().restore(host_slots, storage, device_slots)
        storage.k_buffer[0, device_slots[:1]] += 1.0
        return handle


def scripted(machine: HostTierMachine) -> HostTierMachine:
    """Prompts a, b, c of 12 tokens each take the 20-token device pool in turn (each evicts the one before
    to the 24-token host pool, which drops a to make room), then b comes back from the host."""
    machine.setup()
    a, b, c = [0] * 12, [1] * 12, [2] * 12
    for tokens in (a, b, c, c, b):
        machine.start_request(None, tokens)
        machine.books_balance()
        machine.finish(0)
        machine.books_balance()
    return machine


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_reference_sanity(policy):
    """The scripted run loads back and drops (so the checks above run), and a pool that corrupts one
    restored value fails the bit-exact check."""
    cls = type("M", (HostTierMachine,), {"write_policy": policy})
    good = scripted(cls())
    assert good.loads == 1 and good.drops >= 1
    bad = type("Bad", (HostTierMachine,), {"write_policy": policy, "pool_cls": CorruptingPool})
    with pytest.raises(AssertionError, match="loaded K differs"):
        scripted(bad())
