"""Where the tests find ../shared (the real tokenizer, chat records, videos and reference code)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DIR = Path(os.environ.get("MMPACK_SHARED_DIR", REPO_ROOT.parent / "shared"))
QWEN3_TOKENIZER = SHARED_DIR / "data" / "tokenizer_qwen3" / "tokenizer.json"
MLLM_DEMO_JSON = SHARED_DIR / "data" / "mllm_demo" / "data" / "mllm_demo.json"
