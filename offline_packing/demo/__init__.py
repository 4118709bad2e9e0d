"""`mmpack demo` (cli.py) and the synthetic raw data and tiny tokenizer it and the tests build (synthetic.py)."""
