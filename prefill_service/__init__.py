"""Prefill worker: computes prompts (chunked, batched), samples the first token, sends the KV."""
