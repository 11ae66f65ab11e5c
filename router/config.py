"""RouterArgs: the one configuration object of the router, and the CLI flags built from it.

Like ``runtime.config.ServerArgs``, every field carries its help text, so ``radixserve router --help``
explains every flag. ``add_router_args(parser, prefix="router-")`` adds the same flags with a prefix, which
is how ``radixserve serve --dp N`` accepts router options next to the worker's own flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any

POLICIES = ("cache_aware", "exact", "round_robin", "shortest_queue", "power_of_two")
# Fields that only make sense for a standalone router (``serve --dp`` sets them itself).
API_KEY_ENV = "RADIXSERVE_API_KEY"
STANDALONE_ONLY = ("worker_urls", "kv_events_endpoints", "host", "port", "api_key")


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    meta: dict[str, Any] = {"help": help}
    if choices:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


@dataclass
class RouterArgs:
    # ---------------------------------------------------------------- workers and server
    worker_urls: list[str] = field(default_factory=list, metadata={"help": (
        "Base URLs of the workers (radixserve serve instances), e.g. http://10.0.0.2:30000. More can be added "
        "at run time with POST /workers.")})
    host: str = _opt("127.0.0.1", "Address the router's HTTP server binds to.")
    port: int = _opt(30000, "The router's HTTP port.")
    log_level: str = _opt("info", "Logging level of the router.", ("debug", "info", "warning", "error"))
    # ---------------------------------------------------------------- policy
    policy: str = _opt("cache_aware", "How a request picks its worker: cache_aware = approximate per-worker "
                       "prefix tree of what was routed there; exact = mirror each worker's real radix cache from "
                       "its KV events (workers need --kv-events-port); round_robin; shortest_queue = fewest "
                       "in-flight requests; power_of_two = the less loaded of two random workers.", POLICIES)
    tree_mode: str = _opt("text", "Key of cache_aware's trees: text = the prompt text / chat messages (needs no "
                          "tokenizer, works for remote workers); tokens = token ids (needs the tokenizer, "
                          "like exact).", ("text", "tokens"))
    cache_threshold: float = _opt(0.5, "cache_aware/exact: follow the cache only when the best worker holds at "
                                  "least this share of the prompt; below it, pick the least loaded worker.")
    balance_abs_threshold: int = _opt(8, "Load-imbalance guard: routing for the cache is overruled (least loaded "
                                      "worker instead) when it would leave max - min in-flight requests above "
                                      "this ...")
    balance_rel_threshold: float = _opt(1.5, "... and the busiest worker above this multiple of the least busy.")
    max_tree_size: int = _opt(1 << 22, "cache_aware: most units (text bytes or tokens) kept per worker's tree; "
                              "the least recently used leaves are pruned beyond it.")
    tokenizer: str | None = _opt(None, "Local tokenizer folder for exact mode and tokens trees (default: the "
                                 "tokenizer_path the first worker reports, which must exist on this machine; "
                                 "give it explicitly for remote workers).")
    chat_template: str | None = _opt(None, "A Jinja chat template file, when the workers were started with one "
                                     "(default: the template the worker reports in /get_model_info).")
    kv_events_endpoints: list[str] = field(default_factory=list, metadata={"help": (
        "exact: ZMQ endpoints of the workers' KV events, one per worker URL in the same order (default: "
        "tcp://<worker host>:<kv_events_port from its /get_server_info>).")})
    seed: int = _opt(0, "Seed of power_of_two's random choices.")
    # ---------------------------------------------------------------- load limits and retries
    max_inflight_per_worker: int = _opt(128, "Most requests the router keeps in flight on one worker; more wait "
                                        "in the router's queue, so routing decisions are taken as late as possible.")
    max_queued_requests: int = _opt(256, "Most requests waiting for a worker slot; beyond it requests get 429.")
    queue_timeout: float = _opt(300.0, "Seconds a request may wait for a worker slot before it gets 503.")
    max_retries: int = _opt(2, "Times a request is retried on another worker when its worker fails before the "
                            "response has started (connection refused/reset, 502/503/504).")
    connect_timeout: float = _opt(5.0, "Seconds to connect to a worker.")
    # ---------------------------------------------------------------- health
    health_check_interval: float = _opt(2.0, "Seconds between health checks (GET /health) of each worker.")
    health_check_timeout: float = _opt(5.0, "Seconds a health check may take.")
    health_failure_threshold: int = _opt(3, "Consecutive failed checks that take a healthy worker out (a refused "
                                         "or reset request connection takes it out at once).")
    health_success_threshold: int = _opt(2, "Consecutive passed checks that bring an unhealthy worker back.")
    # ---------------------------------------------------------------- security
    api_key: str | None = _opt(None, "Require 'Authorization: Bearer KEY' on every endpoint but /health (401 "
                               "otherwise) and send the same key to the workers; also read from the "
                               "RADIXSERVE_API_KEY environment variable.")

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {msg}")

        need(self.policy in POLICIES, "policy", f"must be one of {', '.join(POLICIES)}")
        need(0.0 <= self.cache_threshold <= 1.0, "cache_threshold", "must be in [0, 1]")
        need(self.balance_abs_threshold >= 0, "balance_abs_threshold", "must be >= 0")
        need(self.balance_rel_threshold >= 1.0, "balance_rel_threshold", "must be >= 1")
        need(self.max_tree_size >= 1, "max_tree_size", "must be >= 1")
        need(self.max_inflight_per_worker >= 1, "max_inflight_per_worker", "must be >= 1")
        need(self.max_queued_requests >= 0, "max_queued_requests", "must be >= 0")
        need(self.max_retries >= 0, "max_retries", "must be >= 0")
        need(self.health_failure_threshold >= 1, "health_failure_threshold", "must be >= 1")
        need(self.health_success_threshold >= 1, "health_success_threshold", "must be >= 1")
        need(self.health_check_interval > 0, "health_check_interval", "must be > 0")
        need(1 <= self.port <= 65535, "port", "must be in 1..65535")
        need(not self.kv_events_endpoints or len(self.kv_events_endpoints) == len(self.worker_urls),
             "kv_events_endpoints", "give one endpoint per worker URL")
        for url in self.worker_urls:
            need(url.startswith(("http://", "https://")), "worker_urls", f"{url!r} is not an http(s) URL")

    def copy(self, **changes: Any) -> RouterArgs:
        return dataclasses.replace(self, **changes)


# -------------------------------------------------------------------- CLI
_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str, "str | None": str}


def add_router_args(parser: argparse.ArgumentParser | Any, prefix: str = "",
                    exclude: tuple[str, ...] = ()) -> None:
    """One flag per RouterArgs field (``--cache-threshold``), or ``--<prefix>cache-threshold``."""
    for f in fields(RouterArgs):
        if f.name in exclude:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        dest = prefix.replace("-", "_") + f.name
        meta = f.metadata
        if f.type in ("list[str]",):
            parser.add_argument(flag, dest=dest, nargs="*", default=[], help=meta["help"])
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        parser.add_argument(flag, dest=dest, type=_TYPES[str(f.type)], default=default,
                            choices=meta.get("choices"), help=meta["help"])


def router_args_from_namespace(ns: argparse.Namespace, prefix: str = "", **overrides: Any) -> RouterArgs:
    values: dict[str, Any] = {}
    key_prefix = prefix.replace("-", "_")
    for f in fields(RouterArgs):
        key = key_prefix + f.name
        if hasattr(ns, key):
            values[f.name] = getattr(ns, key)
    values.update(overrides)
    if not values.get("api_key"):
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    return RouterArgs(**values)
