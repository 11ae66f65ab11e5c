"""The naive baseline: plain transformers ``generate``, one request at a time, in-process, nothing shared.

This is what a user without a serving runtime would write: each request is tokenized on its own
(completions: the prompt as is; chat: the model's chat template with the generation prompt), run through
``model.generate`` with its KV cache for that request only, and decoded. Greedy requests take one
sequence; sampled ones ``num_return_sequences = n`` with ``torch.manual_seed(seed)`` when the request has a
seed. Generation stops at the tokenizer's end-of-sequence token and at ``<|endoftext|>`` when the
vocabulary has it (the default model ends a turn with ``<|im_end|>`` but may also emit that one). The time
to the first token comes from a streamer (its first call carries the prompt, the second the first new
token). Requests run in the order the HTTP client would send them, sessions step by step.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from runtime.bench.client import RequestRecord, RunResult, count_http_requests
from runtime.bench.paths import portable_path

DTYPES = ("fp32", "bf16")


class _FirstTokenClock:
    """A ``generate`` streamer that only notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_at: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_at is None:  # call 1 carries the prompt
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


class NaiveTransformers:
    """``model.generate`` per request (fp32, ``threads`` torch threads, KV cache within a request only)."""

    def __init__(self, model_dir: str | Path, threads: int = 2, dtype: str = "fp32"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in DTYPES:
            raise ValueError(f"dtype: one of {', '.join(DTYPES)}, got {dtype!r}")
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32 if dtype == "fp32" else torch.bfloat16).eval()
        self.load_s = time.perf_counter() - t0
        stops = {self.tokenizer.eos_token_id}
        vocab = self.tokenizer.get_vocab()
        if "<|endoftext|>" in vocab:
            stops.add(vocab["<|endoftext|>"])
        self.stop_ids = sorted(int(t) for t in stops if t is not None)
        self.model_dir = str(model_dir)
        self.threads = threads
        self.dtype = dtype

    @property
    def target(self) -> str:
        return (f"transformers generate, sequential ({self.dtype}, {self.threads} threads, "
                f"{portable_path(self.model_dir)})")

    def warmup(self) -> None:
        self._send("warmup", "completions", {"prompt": "Warm-up request.", "max_tokens": 4, "temperature": 0.0},
                   time.perf_counter())

    def _prompt_ids(self, endpoint: str, body: dict[str, Any]) -> Any:
        if endpoint == "completions":
            return self.tokenizer(body["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
        enc: Any = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                                      return_dict=True, return_tensors="pt")
        return enc["input_ids"]

    def _send(self, rid: str, endpoint: str, body: dict[str, Any], t0: float) -> RequestRecord:
        import torch

        n = max(int(body.get("n", 1) or 1), 1)
        rec = RequestRecord(rid, endpoint, body, n)
        rec.sent_at = time.perf_counter() - t0
        clock = _FirstTokenClock()
        try:
            ids = self._prompt_ids(endpoint, body)
            temperature = 1.0 if body.get("temperature") is None else float(body["temperature"])  # OpenAI's default
            kwargs: dict[str, Any] = {"max_new_tokens": int(body.get("max_tokens") or 16),
                                      "eos_token_id": self.stop_ids, "pad_token_id": self.tokenizer.pad_token_id,
                                      "use_cache": True, "streamer": clock}
            if temperature > 0:
                if body.get("seed") is not None:
                    torch.manual_seed(int(body["seed"]))
                kwargs.update(do_sample=True, temperature=temperature, top_p=float(body.get("top_p", 1.0)),
                              top_k=0, num_return_sequences=n)
            else:
                kwargs.update(do_sample=False, num_return_sequences=1)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
            produced = 0
            for j, row in enumerate(out[:, ids.shape[1]:].tolist()):
                cut = next((k for k, t in enumerate(row) if t in self.stop_ids), len(row))
                produced += cut
                rec.texts[j] = str(self.tokenizer.decode(row[:cut], skip_special_tokens=True))
            rec.output_tokens = rec.chunks = produced
            rec.prompt_tokens = int(ids.shape[1])
        except Exception as exc:  # one failing request is recorded, as an HTTP error would be
            rec.error = f"{type(exc).__name__}: {exc}"[:200]
        rec.first_token_at = None if clock.first_at is None else clock.first_at - t0
        rec.done_at = time.perf_counter() - t0
        return rec

    def run(self, wl: dict[str, Any], progress: bool = True, label: str = "") -> RunResult:
        records: list[RequestRecord] = []
        bar = tqdm(total=count_http_requests(wl, "native"), desc=label or wl["name"], unit="req",
                   disable=not progress, dynamic_ncols=True)
        t0 = time.perf_counter()
        try:
            if wl["kind"] == "independent":
                for req in wl["requests"]:
                    records.append(self._send(req["id"], req["endpoint"], req["body"], t0))
                    bar.update(1)
            else:
                for sess in wl["sessions"]:
                    history = copy.deepcopy(sess["messages"])
                    for i, step in enumerate(sess["steps"]):
                        history = history + copy.deepcopy(step["append"])
                        rec = self._send(f"{sess['id']}/{i}", "chat", dict(step["body"], messages=history), t0)
                        records.append(rec)
                        bar.update(1)
                        if not rec.ok:
                            bar.update(len(sess["steps"]) - i - 1)
                            break
                        history = history + [{"role": "assistant", "content": rec.texts.get(0, "")}]
            wall = time.perf_counter() - t0
        finally:
            bar.close()
        return RunResult(wl["name"], dict(wl["params"]), wl.get("description", ""), self.target, records, wall)
