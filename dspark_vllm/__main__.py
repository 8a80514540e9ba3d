"""``python -m dspark_vllm check ...``: ``dspark_vllm.check``."""

from dspark_vllm.check import main

raise SystemExit(main())
