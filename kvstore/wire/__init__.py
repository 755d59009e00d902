"""What the client and the service both need to speak `kvstore.v1`: message encoding and checks
(`messages.py`), readers of the wire format that leave payloads and token ids where they arrived
(`wire_format.py`, `pieces.py`, `tokens_in_place.py`), the framing of chunk payloads into stream
messages (`framing.py`), request ids (`request_ids.py`), the purpose of a call that is not an
engine's request (`purposes.py`), the typed bills a reply carries (`bills.py`), whether a target
string names a service (`targets.py`), whether TLS files can make gRPC credentials
(`tls_files.py`), why TLS with a service cannot work (`tls_probe.py`) and what a listener does
when accept() runs short of descriptors or memory (`accept_pause.py`). Nothing here knows the store
or the servicers."""
