"""`kvserve bench {serve, latency, throughput, plot}`: vLLM's benchmark tools, for kvserve and
other OpenAI-compatible servers. Their flags: kvserve/benchmarks/cli.py."""
