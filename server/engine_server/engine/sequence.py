"""One completion's state inside the engine: its tokens, how many are computed, its KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine_server.engine.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from llguidance import LLMatcher


class SequenceStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its constraint compiles; not in the scheduler yet
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """A completion (index `index` of request `request_id`); prompt and generated tokens in one list.

    NOTE: the KV of token_ids[:num_computed_tokens] is in the cache blocks of block_table.
    After a preemption both are reset and the whole list is recomputed (its prompt grows).
    """

    seq_id: int  # engine-wide, increasing: a larger id is a younger sequence
    request_id: str
    index: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int  # resolved: never None, never past max_model_len
    generator: torch.Generator | None = None  # set for seeded requests
    # The request's scheduling order: (priority, arrival); arrival is index 0's seq_id, so siblings share it.
    priority: int = 0
    arrival: int = 0
    # The parent hash of its first KV block: 0, or seeded by the request's cache salt (block_manager.py).
    cache_root: int = 0
    cache_salt: str = ""  # the salt itself, for the cache events that name it (kv_events.py)
    # The LoRA slot its rows read (engine/lora/), pinned for the request's whole life; -1 = the base model.
    lora_slot: int = -1
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full, computed block
    num_cached_prompt_tokens: int = 0  # prompt tokens that came from the prefix cache at first admission
    num_siblings_to_fork: int = 0  # n - 1 until the first token is sampled (index 0 only)
    is_first_output: bool = True
    # Index 0 aborted before its first token while siblings it forks are still wanted: it computes the
    # prompt for them, then ends without sampling.
    is_abort_pending: bool = False
    # Prompt logprobs accumulate chunk by chunk; they ride on the first delta.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # The structured-output constraint's state, advanced by each sampled token (None: unconstrained).
    # NOTE: a preemption keeps it: recomputing the KV changes no token.
    matcher: LLMatcher | None = None
    # llguidance never returned this completion's mask: a stuck call holds the matcher; never touched again
    is_grammar_stuck: bool = False

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: lower priority value first, then earlier arrival (request), then seq_id."""
        return (self.priority, self.arrival, self.seq_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.index == 0 and self.is_first_output

    def reset_for_recompute(self) -> None:
        """After preemption: drop the cache state; the tokens stay and are recomputed."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.block_hashes = []
        self.status = SequenceStatus.WAITING
        if self.wants_prompt_logprobs:
            self.prompt_logprobs = None
