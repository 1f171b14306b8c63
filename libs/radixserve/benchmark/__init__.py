"""`radixserve bench serving`: SGLang-style serving benchmark against any OpenAI-compatible URL.

datasets.py  seeded synthetic workloads (random, sharegpt-like, generated-shared-prefix)
dataset_files.py  the user's files: ShareGPT-format JSON, a JSONL of prompts
client.py    one streamed request, timed per chunk (openai / radixserve backends)
runner.py    Poisson arrivals or all at once, an optional concurrency cap, a progress bar
report.py    throughput, TTFT / TPOT / ITL / e2e percentiles, cache hit rate, goodput; table + JSON
serving.py   the command's flags and entry point
"""
