"""The step's grammar bitmask buffer (engine.step_buffers.GrammarMasks): one allocation reused
across steps, every row reset to "all allowed" each time it is handed out."""

import torch

from engine.step_buffers import GrammarMasks


def test_the_buffer_is_reused_reset_and_grown_only_when_a_step_needs_more_rows():
    masks = GrammarMasks(vocab_size=70)                 # 3 int32 words per row
    first = masks.take(3)
    assert first.shape == (3, 3) and bool((first == -1).all())
    first[1].zero_()                                    # a grammar allowed nothing there
    again = masks.take(2)
    assert again.data_ptr() == first.data_ptr()         # the same memory, not a new tensor
    assert again.shape == (2, 3) and bool((again == -1).all())
    grown = masks.take(7)                               # more rows than any step before
    assert grown.shape == (7, 3) and bool((grown == -1).all())
    assert masks.take(6).data_ptr() == grown.data_ptr()
    assert grown.dtype == torch.int32 and grown.is_contiguous()
