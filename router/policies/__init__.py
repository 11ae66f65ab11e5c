"""Routing policies behind one interface (``base.Policy``); ``make_policy`` builds the one RouterArgs names."""

from __future__ import annotations

from router.config import RouterArgs
from router.policies.base import Choice, Policy, imbalanced
from router.policies.cache_aware import AffinityPolicy, CacheAware
from router.policies.exact import Exact
from router.policies.load_based import PowerOfTwo, RoundRobin, ShortestQueue

__all__ = ["AffinityPolicy", "CacheAware", "Choice", "Exact", "Policy", "PowerOfTwo", "RoundRobin",
           "ShortestQueue", "imbalanced", "make_policy"]


def make_policy(args: RouterArgs) -> Policy:
    if args.policy == "cache_aware":
        return CacheAware(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold,
                          args.max_tree_size, args.tree_mode)
    if args.policy == "exact":
        return Exact(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold)
    if args.policy == "round_robin":
        return RoundRobin()
    if args.policy == "shortest_queue":
        return ShortestQueue()
    if args.policy == "power_of_two":
        return PowerOfTwo(args.seed)
    raise ValueError(f"policy: unknown policy {args.policy!r}")
