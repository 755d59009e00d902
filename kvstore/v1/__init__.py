"""Generated code of the kvstore gRPC API (package `kvstore.v1`), from proto/kvstore/v1/kvstore.proto.

Do not edit the `kvstore_pb2*` files: run `python scripts/gen_proto.py` after changing the .proto.
A test fails when the checked-in files are stale.
"""
