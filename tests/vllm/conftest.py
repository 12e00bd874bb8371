"""The vLLM tests run under a vLLM venv with reshard installed in it (scripts/dev's vLLM
stage); elsewhere they are not collected."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
