"""The gateway: OpenAI-compatible REST and gRPC front door.

Module map (dependencies point down; nothing here imports torch or transformers):

    server.py       main(args): one asyncio loop running uvicorn, the gRPC server and discovery
    openai_api.py   FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health
    grpc_api.py     Generation.Generate servicer + grpc.health.v1
    protocol.py     pydantic request models of the REST API, OpenAI-style error bodies
    params.py       shared validation: raw inputs -> PreparedRequest (used by REST and gRPC)
    pipeline.py     drives one request through a decode and a prefill worker -> Delta stream
    router.py       worker discovery in Redis, worker choice, gRPC channels
    tokenizer.py    tokenizer.json, chat template, EOS ids, incremental detokenizer
"""
