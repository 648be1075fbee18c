"""The shared engine core: model code, paged KV cache, scheduler and sampler.

The engine never imports grpc or redis; the services wrap it.
"""
