"""The reference CED model: a small compressed-encoder/decoder model whose cache has the same
shape as DeepSeek-V4.1's (global records plus a sliding window), used by the in-process runner, the
demo and the replay-quality check. Importing `replay.reference.model` loads torch."""
