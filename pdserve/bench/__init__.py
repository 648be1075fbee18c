"""`pdserve bench`: a load generator for any OpenAI-compatible /v1/completions server.

    workloads.py  exact-length prompts from random token ids; Poisson arrivals
    client.py     one streamed request, timed per chunk
    stats.py      per-request results, percentiles, throughput, goodput
    runner.py     load points (closed loop / open loop / long-burst) and the command
    report.py     tables, the JSON file, `pdserve bench compare`
    plot.py       the PNG (matplotlib)

Torch-free by design: it runs beside any server, and it tokenizes with `tokenizers` only.
"""
