"""Chunk keys: the chained SHA-256 that names each chunk of a prompt within its namespace
(`chunk_keys.py`), the same chain hashed in one compiled loop (`chain.py`, `chain_loop.py`), and the
memo that spares a prompt seen again its hashing (`memo.py`)."""
