"""The gRPC service around the store: servicers, auth, limits, health, the server and its composition.

`app.build_app(config)` composes the store, the local pool, the runner registry and (when present) the
replay coordinator; `server.KvstoreServer` serves them. Only the servicers in this package map
kvstore's exceptions to gRPC status codes (`codes.py`). Importing this package is cheap: submodules
are imported where used.
"""
