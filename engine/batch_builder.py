"""A step's host side around the model runner: the scheduler's output flattened into the
runner's StepInputs, and the runner's StepResult turned back into tokens per request.

    SchedulerOutput --inputs()--> StepInputs --ModelRunner.execute--> StepResult
                                                    --tokens()--> tokens, logprobs per request

`proposals` (request id -> engine.spec.Proposal) are the step's speculative proposals: a
request verifying k of them has 1 + k sampled rows, and its tokens are the accepted proposals
and the target's own (greedy: compared with the rows' argmaxes; a draft model's sampled
proposals: rejection sampling over the rows' logits).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from engine.attention.base import BatchLayout
from engine.model_runner import StepInputs, StepResult
from engine.request import Request
from engine.sampler import RowSampling
from engine.scheduler import SchedulerOutput
from engine.spec.verify import accept_greedy, verify
from engine.step_buffers import GrammarMasks


class PromptRows:
    """The rows of a step whose logits give prompt logprobs: a row at prompt position p scores
    prompt token p + 1 (the last prompt position scores the first output token: not a prompt
    logprob). A position already scored (a recompute after preemption) is not scored again."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.targets: list[int] = []
        self.top = 0
        self.owners: list[tuple[Request, int]] = []

    def add(self, req: Request, base: int, start: int, end: int) -> None:
        """`req`'s tokens [start, end) are the step's rows base, base + 1, ..."""
        lo = max(start, len(req.prompt_logprobs) - 1)
        hi = min(end, req.num_prompt_tokens - 1)
        if lo >= hi:
            return
        self.rows.extend(range(base + lo - start, base + hi - start))
        self.targets.extend(req.prompt_token_ids[lo + 1:hi + 1])
        self.top = max(self.top, req.params.prompt_logprobs)
        self.owners.append((req, hi - lo))


class BatchBuilder:
    """`block_table(request_id)`: the request's tables, one per KV group (the KV cache
    manager's group_tables);
    `table_id(request_id)`: the id that table lives under (None: tables are not named, and a
    backend uploads each whole every step)."""

    def __init__(self, block_table: Callable[[str], list[list[int]]], vocab_size: int,
                 table_id: Callable[[str], int | None] | None = None) -> None:
        self.block_table = block_table
        self.table_id = table_id
        self.lora_slots: dict[str, int] = {}      # the step's adapters' slots (by digest)
        self.masks = GrammarMasks(vocab_size)

    def inputs(self, sched: SchedulerOutput, proposals: dict) -> StepInputs:
        """Flatten the scheduled requests into the step's inputs: token ids [T], each
        sequence's layout, and the rows [S] whose logits are sampled (the last position, and
        each proposal's) with how each is sampled."""
        ids, tables, starts, q_lens, sample_rows, rows = [], [], [], [], [], []
        rope_long: list[bool] = []
        lora_slots: list[int] = []
        table_ids: list[int | None] | None = [] if self.table_id is not None else None
        grammar_rows: list[tuple[Request, int, int]] = []    # (request, first row, proposals)
        prompt = PromptRows()
        for s in sched.scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            if req.prompt_logprobs is not None:
                prompt.add(req, len(ids), start, end)
            ids.extend(req.token_ids_between(start, end, with_spec=bool(s.num_spec)))
            tables.append(self.block_table(req.request_id))
            if table_ids is not None:
                table_ids.append(self.table_id(req.request_id))
            starts.append(start)
            q_lens.append(s.num_new_tokens)
            rope_long.append(req.long_rope)
            lora_slots.append(-1 if req.lora is None else self.lora_slots[req.lora.digest])
            if s.sample:
                first = len(ids) - 1 - s.num_spec
                sample_rows.extend(range(first, len(ids)))
                if req.structured_state is not None:
                    grammar_rows.append((req, len(rows), s.num_spec))
                rows.extend(self._rows(req, s.num_spec, proposals))
        bitmask = None
        if grammar_rows:
            bitmask = self._grammar_masks(grammar_rows, len(rows))
            for req, first, k in grammar_rows:
                if not req.params.min_tokens:
                    continue
                for j in range(first, first + 1 + k):      # min_tokens yields to the end
                    if req.structured_state.allows_only_end(bitmask, j):
                        rows[j] = replace(rows[j], grammar_ends=True)
        return StepInputs(ids, BatchLayout.of_groups(tables, starts, q_lens, table_ids,
                                                     rope_long, lora_slots),
                          sample_rows,
                          rows, bitmask,
                          prompt.rows, prompt.targets, prompt.top, prompt.owners)

    @staticmethod
    def add_prompt_logprobs(inp: StepInputs, result: StepResult) -> None:
        """The step's prompt logprobs onto their requests (before the scheduler's update, so
        the first token's output carries them complete)."""
        i = 0
        for req, n in inp.prompt_owners:
            k = req.params.prompt_logprobs
            for lp in result.prompt_logprobs[i:i + n]:
                req.prompt_logprobs.append(replace(lp, top=lp.top[:k]))
            i += n

    @staticmethod
    def _rows(req: Request, num_spec: int, proposals: dict) -> list[RowSampling]:
        """The sampled rows of a request: its next token, and with proposals one per proposal
        (row j follows the first j proposals: its history holds them)."""
        p, index = req.params, len(req.output_token_ids)
        # rows are drawn here unless a draft model's proposals are verified by rejection
        # sampling (point-mass proposals compare with the rows' own draws: engine.spec.verify)
        prop = proposals.get(req.request_id) if num_spec else None
        plain = prop is None or prop.probs is None
        if not (p.penalized or p.min_tokens):
            return [RowSampling(p, index + j, plain) for j in range(1 + num_spec)]
        out, spec = req.output_token_ids, req.spec_token_ids
        prompt = req.prompt_token_ids if p.repetition_penalty != 1.0 else ()
        return [RowSampling(p, index + j, plain, out + spec[:j] if j else out, prompt)
                for j in range(1 + num_spec)]

    def _grammar_masks(self, grammar_rows, num_rows: int):
        """The step's token bitmask [rows, words]: every token allowed, but in the rows of
        requests with a grammar, what it allows there (a verification row: after the
        proposals before it)."""
        bitmask = self.masks.take(num_rows)
        for req, first, k in grammar_rows:
            if k:
                req.structured_state.fill_draft_masks(req.spec_token_ids[:k], bitmask, first)
            else:
                req.structured_state.fill_mask(bitmask, first)
        return bitmask

    @staticmethod
    def tokens(sched: SchedulerOutput, result: StepResult, proposals: dict):
        """Tokens per sampled request from the step's batched sampling: its row's token, or,
        verifying proposals, the accepted ones and the target's (greedy: from the rows'
        argmaxes; sampled: rejection sampling over the rows' logits)."""
        tokens: list[list[int]] = []
        logprobs: list[list] = []
        row = 0
        for s in sched.scheduled:
            if not s.sample:
                continue
            req, n = s.request, 1 + s.num_spec
            if not s.num_spec:
                tokens.append([result.tokens[row]])
                logprobs.append([result.logprobs[row]])
            elif req.params.greedy or proposals[req.request_id].probs is None:
                toks = accept_greedy(req.spec_token_ids, result.tokens[row:row + n])
                tokens.append(toks)
                logprobs.append(result.logprobs[row:row + len(toks)])
            else:
                probs = proposals[req.request_id].probs
                toks, lps = verify(result.logits[row:row + n], req.params,
                                   len(req.output_token_ids), req.spec_token_ids,
                                   None if probs is None else probs[:s.num_spec],
                                   processed=result.processed[row:row + n])
                tokens.append(toks)
                logprobs.append(lps)
            row += n
        return tokens, logprobs
