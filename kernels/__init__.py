"""Triton kernels, each beside a pure-torch reference (paged attention, KV store, norms, rotary).

The engine runs on its torch references today (engine/attention.py); kernels land here with a
test against their reference. Note: this package shares its name with an unrelated PyPI package
that transformers probes for; tests/test_layout.py checks transformers does not pick ours up.
"""
