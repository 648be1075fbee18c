"""`pdserve baseline KIND`: reference servers with our REST API, to measure pdserve against.
Each kind's server module is imported only when it runs (`hf`: pdserve.baseline_hf, which loads
torch, transformers and FastAPI)."""

from __future__ import annotations

from pdserve.flags import DefaultsFormatter, add_model


def register(sub) -> None:
    """The `baseline` command and its kinds."""
    baseline = sub.add_parser("baseline", help="reference servers to measure pdserve against",
                              description="Reference servers with the same REST API as ours.")
    kinds = baseline.add_subparsers(dest="baseline_command", required=True, metavar="KIND")
    hf = kinds.add_parser(
        "hf", help="HF transformers with static batching",
        formatter_class=DefaultsFormatter,
        description="Serve an HF model with STATIC batching behind /v1/completions (streaming,\n"
                    "usage, ignore_eos, temperature), /v1/models and /health: a batch of up to\n"
                    "--batch-size requests gathered within --batch-wait-ms runs to completion\n"
                    "before the next batch starts.")
    add_model(hf)
    hf.add_argument("--host", default="127.0.0.1", help="address to bind")
    hf.add_argument("--port", type=int, default=8100, help="HTTP port")
    hf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights dtype")
    hf.add_argument("--batch-size", type=int, default=16, help="most requests in one batch")
    hf.add_argument("--batch-wait-ms", type=float, default=50.0,
                    help="how long the batch former waits for more requests")
    hf.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    hf.add_argument("--log-level", default="INFO")
    hf.set_defaults(target="pdserve.baseline_hf:main")
