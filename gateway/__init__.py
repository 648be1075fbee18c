"""The gateway: OpenAI-compatible REST and gRPC front door.

Module map (dependencies point down; nothing here imports torch or transformers):

    server.py         main(args): one asyncio loop running uvicorn, the gRPC server and discovery
    openai_api.py     FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health
    grpc_api.py       Generation.Generate servicer + grpc.health.v1
    protocol.py       pydantic request models of the REST API, OpenAI-style error bodies
    params.py         GenerationParams (checked once, at the edge) -> PreparedRequest
    pipeline.py       one request through a decode and a prefill worker: attempts, retries,
                      moved streams -> Delta stream
    choice_text.py    a choice's text state: detokenizer, stop strings
    worker_errors.py  a failed worker call as the client's error
    router.py         worker discovery in Redis, worker choice, gRPC channels
    tools/            tool calling: validation, output parsers per format, forced calls
    chat_template.py  the chat template and how tools reach the prompt
    tokenizer.py      tokenizer.json, EOS ids, incremental detokenizer
"""
