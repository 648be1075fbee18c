"""Proposers: where speculative tokens come from.

`propose(reqs, ks)` returns, for each decoding request, up to ks[i] tokens that would follow its
tokens so far (and, for a draft model sampling at temperature > 0, the distribution each was
drawn from, which rejection sampling needs). Proposals never change a request.

  * NgramProposer: prompt lookup. The last n tokens (n from max_n down to min_n) are looked up
    among the request's earlier tokens (prompt and output); the tokens that followed their
    first occurrence are proposed (on code edits the first is the original in the prompt, and
    it was accepted more often than the latest: 1.66x vs 1.62x in a replay of greedy outputs).
    The proposal says how long the match is, counted back past max_n (up to MAX_MATCH): a
    proposal after a 12-token match was accepted 19 times in 20, after a 2-token match fewer
    than half the time, so the controller keeps acceptance per match length. Free to compute,
    so the engine asks it for the full k first and lets the controller keep what is worth
    verifying. Each request keeps an index {n-gram: where it first ended}, extended
    incrementally as tokens arrive.
  * DraftProposer: a smaller model with the same vocabulary. Its KV is recomputed on the decode
    worker (not transferred from prefill): it has its own paged pool and catches up on each
    request's tokens (the whole prompt in the request's first speculative step, then the tokens
    accepted since), then decodes k tokens batched across requests.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.attention.base import BatchLayout
from engine.block_pool import BlockPool
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner, StepInputs
from engine.request import Request
from engine.sampler import draw_rows, sampling_probs, uniform

_DRAFT_SEED_SALT = 0x5EED_D4AF7


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None     # [len(tokens), vocab]: the draft's q, when sampled
    kind: int = 0    # proposals alike in how likely they are accepted (n-gram: match length)

    def truncated(self, k: int) -> "Proposal":
        return Proposal(self.tokens[:k], None if self.probs is None else self.probs[:k],
                        self.kind)


class Proposer(abc.ABC):
    name: str
    free = False           # proposing costs nothing: the engine asks for the full k first

    @abc.abstractmethod
    def propose(self, reqs: list[Request], ks: list[int]) -> list[Proposal]: ...

    def verified(self, req: Request) -> None:
        """After verification: tokens [0, req.num_computed_tokens) are final."""

    def release(self, request_id: str) -> None:
        """The request is finished or aborted."""


class NgramProposer(Proposer):
    name = "ngram"
    free = True
    MAX_MATCH = 16

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, tuple[int, dict[tuple[int, ...], int]]] = {}

    def _lookup(self, req: Request) -> tuple[list[int], dict[tuple[int, ...], int]]:
        tokens = req.all_token_ids
        done, index = self._index.get(req.request_id, (0, {}))
        if done > len(tokens) - 1:             # fewer tokens than indexed (cannot happen
            done, index = 0, {}                # today; be safe if a request is rewound)
        # index n-grams ending at positions [done, len - 2]: the suffix itself is not a match
        for end in range(done, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                index.setdefault(tuple(tokens[end - n + 1:end + 1]), end)
        self._index[req.request_id] = (max(done, len(tokens) - 1), index)
        return tokens, index

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Proposal]:
        out = []
        for req, k in zip(reqs, ks):
            if k <= 0:
                out.append(Proposal([]))
                continue
            tokens, index = self._lookup(req)
            found, match = [], 0
            last = len(tokens) - 1
            for n in range(min(self.max_n, last), self.min_n - 1, -1):
                end = index.get(tuple(tokens[-n:]))
                if end is not None:
                    found, match = tokens[end + 1:end + 1 + k], n
                    while (match < self.MAX_MATCH and end - match >= 0
                           and tokens[end - match] == tokens[last - match]):
                        match += 1
                    break
            out.append(Proposal(found, kind=match))
        return out

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)


class DraftProposer(Proposer):
    """A draft model on the decode worker, with its own KV pool of `num_blocks` blocks."""

    name = "draft"

    def __init__(self, model_dir: str | Path, target: ModelConfig, cfg: EngineConfig,
                 num_blocks: int, model: torch.nn.Module | None = None) -> None:
        self.mcfg = ModelConfig.from_dir(model_dir)
        if self.mcfg.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model at {model_dir} has a vocabulary of "
                             f"{self.mcfg.vocab_size} tokens, the target {target.vocab_size}: "
                             "a draft must share the target's tokenizer")
        self.device = torch.device(cfg.device)
        # its own runner: its own KV pool (num_blocks), buffers and decode graphs
        self.runner = ModelRunner(model_dir, self.mcfg,
                                  replace(cfg, num_blocks=num_blocks, speculative="off",
                                          enable_lora=False,    # proposals of the base model
                                          tensor_parallel_size=1,
                                          # a draft checkpoint's own quantization, or int8
                                          quantization="int8" if cfg.quantization == "int8"
                                          else "none"), model)
        self.model = self.runner.model
        self.block_size = cfg.block_size
        self.kv_manager = KVCacheManager(BlockPool(num_blocks), cfg.block_size, None,
                                         self.runner.groups)
        self.computed: dict[str, int] = {}        # tokens whose draft KV is valid

    def _forward(self, ids: list[int], tables: list[list[int]], starts: list[int],
                 q_lens: list[int], table_ids: list[int | None]) -> torch.Tensor:
        """Logits [num sequences, vocab] at each sequence's last new position."""
        last, end = [], 0
        for n in q_lens:
            end += n
            last.append(end - 1)
        inputs = StepInputs(ids, BatchLayout.of_groups(tables, starts, q_lens, table_ids), last,
                            [])
        return self.runner.execute(inputs).logits

    @staticmethod
    def _pick(logits: torch.Tensor, reqs: list[Request], indices: list[int]
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each row's draft token (greedy, or drawn from its sampling distribution at its own
        uniform number) and that distribution (None when greedy): the whole step's tokens come
        to the host in one transfer."""
        tok = logits.argmax(-1)                                          # [R]
        qs: list[torch.Tensor | None] = [None] * len(reqs)
        drawn = [r for r, req in enumerate(reqs) if not req.params.greedy]
        if drawn:
            for r in drawn:
                qs[r] = sampling_probs(logits[r], reqs[r].params)
            us = [uniform(reqs[r].params.seed ^ _DRAFT_SEED_SALT, indices[r]) for r in drawn]
            rows = torch.tensor(drawn, device=logits.device)
            tok = tok.index_copy(0, rows, draw_rows(torch.stack([qs[r] for r in drawn]), us))
        return tok.tolist(), qs

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Proposal]:
        props = [Proposal([]) for _ in reqs]
        live: list[int] = []
        ids, tables, starts, q_lens = [], [], [], []
        table_ids: list[int | None] = []
        for i, (req, k) in enumerate(zip(reqs, ks)):
            if k <= 0:
                continue
            rid, n = req.request_id, req.num_tokens
            start = min(self.computed.get(rid, 0), n - 1)
            # room for the catch-up and the k - 1 proposals fed back in
            if self.kv_manager.allocate_slots(rid, n + k - 1) is None:
                continue                                  # draft pool full: no proposal
            live.append(i)
            ids.extend(req.all_token_ids[start:n])
            tables.append(self.kv_manager.group_tables(rid))
            table_ids.append(self.kv_manager.table_id(rid))
            starts.append(start)
            q_lens.append(n - start)
        if not live:
            return props
        logits = self._forward(ids, tables, starts, q_lens, table_ids)
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        toks, qs = self._pick(logits, [reqs[i] for i in live],
                              [len(reqs[i].output_token_ids) for i in live])
        for row, i in enumerate(live):
            tok, q = toks[row], qs[row]
            props[i].tokens.append(tok)
            if q is not None:
                probs[i].append(q)
            self.computed[reqs[i].request_id] = reqs[i].num_tokens
        for j in range(1, max(ks[i] for i in live)):       # batched draft decode steps
            step = [i for i in live if ks[i] > j]
            if not step:
                break
            ids, tables, starts, table_ids = [], [], [], []
            for i in step:
                req = reqs[i]
                p = req.num_tokens + j - 1                   # position of the fed draft token
                ids.append(props[i].tokens[-1])
                tables.append(self.kv_manager.group_tables(req.request_id))
                table_ids.append(self.kv_manager.table_id(req.request_id))
                starts.append(p)
            logits = self._forward(ids, tables, starts, [1] * len(step), table_ids)
            toks, qs = self._pick(logits, [reqs[i] for i in step],
                                  [len(reqs[i].output_token_ids) + j for i in step])
            for row, i in enumerate(step):
                req = reqs[i]
                tok, q = toks[row], qs[row]
                props[i].tokens.append(tok)
                if q is not None:
                    probs[i].append(q)
                self.computed[req.request_id] = req.num_tokens + j
        for i in live:
            if probs[i]:
                props[i].probs = torch.stack(probs[i])
        return props

    def verified(self, req: Request) -> None:
        rid = req.request_id
        if rid in self.computed:
            self.computed[rid] = min(self.computed[rid], req.num_computed_tokens)

    def release(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
        self.kv_manager.free(request_id)
