"""Structured outputs: token masks that keep a sequence's output inside a JSON schema, a
regex, a fixed choice or an EBNF grammar (xgrammar underneath).

    spec = StructuredSpec("json_schema", schema_text)       # what the request asks for
    compiler = GrammarCompiler(model_dir, vocab_size, eos_token_ids)    # one per worker
    matcher = compiler.compile(spec).matcher()               # one per sequence (GrammarError)
    bitmask = new_bitmask(rows, vocab_size)                  # int32 [rows, words], all allowed
    matcher.fill_mask(bitmask, row)                          # per step, per structured row
    apply_bitmask(logits, bitmask.to(logits.device))         # before sampling: banned -> -inf
    matcher.accept(token)                                    # after sampling

Output format: json_object / json_schema leave the layout to the model (whitespace between
elements, at most grammar.MAX_JSON_WHITESPACE characters in a row, so it cannot loop on
whitespace); a spec marked compact gets one line (", " and ": ", no other whitespace);
properties a schema does not name are not generated (xgrammar's strict mode). The model's EOS ids are the
grammar's stop tokens: allowed once the output may end, the only choice once it must, and
accepting one makes `terminated` true. A max_tokens cut just ends the request ("length") with
an incomplete output. Speculative decoding: valid_prefix truncates a proposal to what the
grammar accepts, fill_draft_masks gives the masks of the verified positions.

Cost (pdserve/bench/grammarbench.py): compiles are cached, but a first compile can take most
of a second when a schema or regex has bounded repetition (maxLength, {m,n}); compile off the
engine thread (xgrammar releases the GIL). fill_mask is a few microseconds for typical states.
"""

from engine.structured.bitmask import apply_bitmask, bitmask_words, new_bitmask
from engine.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarMatcher
from engine.structured.spec import KINDS, GrammarError, StructuredSpec

__all__ = ["KINDS", "StructuredSpec", "GrammarError", "GrammarCompiler", "CompiledGrammar",
           "GrammarMatcher", "bitmask_words", "new_bitmask", "apply_bitmask"]
