"""The embedded OpenAI-compatible server (``eagle3nb serve``): FastAPI app, batching engine, speculative engine,
vLLM's ``extract_hidden_states`` contract; and the real vLLM as a server process (``serve.vllm``). Start either
from Python with ``eagle3nb.launch.start_server`` / ``eagle3nb.serve.vllm.start_vllm``."""
