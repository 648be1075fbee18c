"""Loaded at start-up by a worker whose PYTHONPATH begins with this folder (tests only): every
KV checksum the worker computes is one more than the blocks' own, so whatever it sends over any
transport is refused by its receiver as corrupted KV. The receiver's process computes the real
checksums. Nothing else changes."""

import engine.kv_checksum as _kv_checksum


def _off_by_one(fn):
    def wrong(*args, **kwargs):
        return fn(*args, **kwargs) + 1
    return wrong


for _name in ("checksums", "block_checksums", "gathered_checksums"):
    setattr(_kv_checksum, _name, _off_by_one(getattr(_kv_checksum, _name)))
