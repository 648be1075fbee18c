"""Decode worker: reserves KV blocks for prompts, receives their KV, generates the rest."""
