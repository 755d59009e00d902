"""Benchmarks (`kvstore bench ...`). Each states its figures as ratios to a raw baseline measured
in the same run on the same machine, because machines are shared and noisy. Benchmarks print;
tests never assert on wall-clock speed."""
