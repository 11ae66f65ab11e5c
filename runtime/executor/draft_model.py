"""The draft model of ``--speculative-algorithm draft``: a smaller model beside the served one, with KV for every
slot of the served model's pool.

**One set of books, two KV storages.** The draft model has its own :class:`KVStorage` with the served pool's
slot count and page size, indexed by the same slot numbers; the allocator, the radix tree and the
request-to-token table stay the served model's alone. The :class:`ModelRunner` runs every batch it runs through
the draft model too, over the same ``ForwardBatch`` (:meth:`DraftModel.mirror`): prompt chunks, decodes,
verified drafts. So every slot the served model computed holds the draft model's KV of the same token at the
same position, and a prefix the radix cache hands to a request (a hit, a retracted request resuming, ``n > 1``)
has valid draft KV exactly where it has served KV. The accounting invariant counts slots, each of which holds
both: nothing in it changes. What would break this is KV that reaches a slot without a forward: the host and
disk tiers load served KV only, so ``--enable-hierarchical-cache`` is refused with a draft model
(``ServerArgs``).

**Drafting** (:meth:`DraftModel.greedy`, driven by ``runtime.speculative.model_drafter``) runs decode rows over
slots the scheduler allocated for the draft, writing the draft model's KV there; the mirror of the verifying
forward then rewrites those slots with the same tokens at the same positions, and the rejected ones are freed
with the served model's.

**Memory**: the draft's weights, and ``capacity x`` its KV bytes per token. The runner sizes the pool so that
both storages fit the KV budget (``--max-total-tokens`` fixes the capacity instead, and both are allocated).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from radix.kv_storage import KVShape, KVStorage
from runtime.config import ServerArgs
from runtime.core.forward_batch import ForwardBatch, build_forward_batch
from runtime.executor.model_build import build_model, kv_shape, source_of
from runtime.models.errors import ModelLoadError
from runtime.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def check_draft_vocab(name: str, draft_config: Any, target_config: Any) -> None:
    """A draft proposes token ids that the served model verifies: both must mean the same tokens."""
    draft, target = int(draft_config.vocab_size), int(target_config.vocab_size)
    if draft != target:
        raise ValueError(f"speculative_draft_model: {name} has a vocabulary of {draft} tokens and the served "
                         f"model one of {target}; --speculative-draft-model needs a model with the served "
                         "model's tokenizer")


def load_draft(args: ServerArgs, target_config: Any, device: torch.device) -> DraftModel | None:
    """The draft model ``args`` ask for (None: none, or the overlap loop runs, which does not speculate and
    says so in ``runtime.scheduler.speculation``)."""
    if args.speculative_draft_model is None or args.overlap_schedule(device.type):
        return None
    try:
        source = source_of(args.speculative_draft_model)
    except ModelLoadError as exc:  # the message names the path; this names the flag too
        raise ValueError(f"speculative_draft_model: {exc}") from exc
    check_draft_vocab(args.speculative_draft_model, source.hf_config, target_config)
    model, _backend = build_model(args, source, device, None)
    return DraftModel(args.speculative_draft_model, model, kv_shape(args, model), device)


class DraftModel:
    def __init__(self, name: str, model: LlamaForCausalLM, shape: KVShape, device: torch.device):
        self.name = name
        self.model = model
        self.kv_shape = shape
        self.device = device
        self.kv: KVStorage | None = None  # set by attach(), once the served pool is sized
        self._table: torch.Tensor | None = None  # the served model's request-to-token table

    def attach(self, total_slots: int, page_size: int, req_to_token: torch.Tensor) -> None:
        """Allocate the draft KV storage for a pool of ``total_slots`` slots (the served pool's) and read slot
        numbers from the served model's request-to-token table."""
        self.kv = KVStorage(self.kv_shape, total_slots, page_size, self.device)
        self._table = req_to_token
        logger.info("draft model %s: %d layers, KV for every one of the %d slots (%.0f MiB)", self.name,
                    self.kv_shape.num_layers, total_slots, self.kv.nbytes / 2**20)

    def release(self) -> None:
        """Free the draft's KV storage and weights (the runner that holds it has stopped)."""
        if self.kv is not None:
            self.kv.release()
        self.model.to("meta")

    @torch.inference_mode()
    def mirror(self, batch: ForwardBatch) -> None:
        """Run a batch the served model just ran over the draft KV storage: the draft model's KV of the same
        tokens lands in the same slots. The hidden states are not needed (drafting reads its own rows)."""
        assert self.kv is not None, "attach() first"
        self.model.forward(dataclasses.replace(batch, kv=self.kv, attn_metadata=None))

    @torch.inference_mode()
    def greedy(self, tokens: list[int], positions: list[int], rows: list[int]) -> list[int]:
        """One decode row per request: ``tokens[i]`` at ``positions[i]`` of request-table row ``rows[i]`` (its
        slot allocated already, the positions before it computed). Writes the rows' draft KV and returns each
        row's most likely next token."""
        assert self.kv is not None and self._table is not None, "attach() first"
        table = self._table
        loc = table[torch.tensor(rows), torch.tensor(positions)]
        batch = build_forward_batch([[t] for t in tokens], positions, rows, loc, self.kv, table, self.device)
        logits = self.model.compute_logits(self.model.forward(batch))
        return [int(t) for t in logits.argmax(-1).tolist()]
