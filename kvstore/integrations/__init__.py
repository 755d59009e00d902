"""Integrations: kvstore plugged into inference engines through their own extension points.

Each engine has its own sub-package, imported only where that engine is installed (for vLLM:
`pip install kvstore[vllm]`, see the README). An integration speaks to the service through
`kvstore.client` only, like any other engine would.
"""
