"""`mmpack demo` (cli.py), part of the application layer above the four parts, and the synthetic raw data,
videos and tiny tokenizer it, the tests and the benchmarks build (synthetic.py, videos.py)."""
