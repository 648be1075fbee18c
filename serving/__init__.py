"""The serving code the prefill and decode workers share: identity and registration, grammar
compilation, admission errors as gRPC statuses, and the worker process's start (`serving.worker`)."""
