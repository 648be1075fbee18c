"""What every process of one deployment shares, torch-free: the cluster credential (auth), the
worker registry and prefix directory in Redis, Prometheus metrics, model paths and health probes.

The gateway, the KV transports, the workers and the CLI import this floor; it imports nothing of
ours above it (engine.block_hash, the standard-library block hash, is the one exception)."""
