"""Small pure policies: eviction, admission and TTL. No I/O, no logging, no metrics in here."""
