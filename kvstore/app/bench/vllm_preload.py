"""What the fork server of :mod:`kvstore.app.bench.vllm_engine` imports before it forks engines.

The environment every engine shares is set here, in the server, before vLLM is imported:
huggingface_hub reads its offline switch when it is imported, and vLLM decides its log colours
then. An engine's own settings (``EngineSpec.env``, the KV cache size) are applied in the engine
before vLLM reads them; vLLM reads its variables lazily until an engine is built. A fork server
that multiprocessing restarts imports this module again, so it gets the same environment.
"""

import importlib
import os

BASE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_COLOR": "0"}

os.environ.update(BASE_ENV)
importlib.import_module("vllm.entrypoints.llm")  # vLLM's LLM class and everything it imports
