"""LoRA adapters: loading and checking them (adapter.py), the batched projections that apply
many at once (layers.py), and the registry with the device slots (manager.py)."""
