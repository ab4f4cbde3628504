"""The model side: loading and saving checkpoints (``io``), the prompt | response batch (``batch``), one
adapter per model family (``adapters``), the forward/decode engine (``engine``), the tools block of chat
templates that have none (``tool_prompt``) and the ``Policy`` that puts them together (``policy``).

Knows nothing about environments, rewards or the training loop.
"""
