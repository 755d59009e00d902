"""Tiers move bytes and decide nothing: device memory, host DRAM, and LMDB on SSD."""
