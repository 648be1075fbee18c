"""Moving KV blocks between workers.

One interface split by role: a `KVSender` on prefill workers, a `KVReceiver` on decode workers.
Transports register by name (`register_transport`) and are created lazily from a flag
(`--kv-transport`): `grpc` (a stream into the decode worker's PushKV RPC), `nixl`
(one-sided WRITEs into the decode worker's registered pool), `torch` (torch.distributed send/recv
on a two-rank group per worker pair: gloo on CPUs, NCCL on GPUs). See kvtransfer.base for the
contract, kvtransfer.integrity for the block checksums and the rules every receiver holds what it
receives to.
"""

from kvtransfer.base import (KVReceiver, KVSender, KVSendStream, KVSink, KVTransferError,
                             LayoutMismatch, TransferTarget, block_bytes, check_layout,
                             create_receiver, create_sender, register_transport, transports)

__all__ = ["KVReceiver", "KVSender", "KVSendStream", "KVSink", "KVTransferError", "LayoutMismatch",
           "TransferTarget", "block_bytes", "check_layout", "create_receiver", "create_sender",
           "register_transport", "transports"]
