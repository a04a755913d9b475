"""`qiao bench`: benchmarks that report against this machine's measured ceilings.

- `hw`: memory-copy bandwidth and matmul rates (the ceilings every other report divides by).
- `throughput`: offline tokens/s through `LLM.generate`, optionally beside Hugging Face.
- `latency`: prefill and per-token decode time through the engine's `step()`.
- `serve`: an open-loop load generator for any OpenAI-compatible server.

Each module imports torch or transformers lazily where it can, so `qiao bench --help` stays fast.
"""
