"""Wire messages. `pdserve_pb2*` are generated from pdserve.proto by `python -m proto.build`
(the Makefile and the Dockerfile run it); never edit them by hand."""
