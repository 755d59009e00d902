"""What the client and the service both need to speak `kvstore.v1`: message encoding and checks
(`messages.py`), the framing of chunk payloads into stream messages (`framing.py`), request ids
(`request_ids.py`), the purpose of a call that is not an engine's request (`purposes.py`) and the
typed bills a reply carries (`bills.py`). Nothing here knows the store or the servicers."""
