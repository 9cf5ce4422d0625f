"""Online serving: continuous batching over a shared-prefix radix cache and an OpenAI-compatible
HTTP server.

* :mod:`.radix` -- :class:`PrefixCache`, prompts cached as token-keyed block chains on the engine's
  paged pool (reference counts by structure, LRU eviction).
* :mod:`.scheduler` -- :class:`Scheduler`, continuous batching (admission by free KV pages,
  preemption) on its own engine thread.
* :mod:`.parallel` -- :class:`ReplicatedScheduler`, the same loop on every rank of a tensor-parallel
  / sequence-sharded server (``treeattn serve --tp N --sp M`` under torchrun).
* :mod:`.sampling` -- a step's token choice for rows with different OpenAI sampling options.
* :mod:`.chat` -- a model's chat template, rendered as transformers renders it (needs ``jinja2``).
* :mod:`.protocol`, :mod:`.server` -- ``/v1/completions`` and ``/v1/chat/completions`` validation and
  the FastAPI app (needs ``fastapi`` and ``uvicorn``; ``/metrics`` needs ``prometheus-client``).
* :mod:`.bench` -- replay of PAT's conversation trace against a server (needs ``httpx``).
"""
from treeattn.serve.parallel import ReplicatedScheduler
from treeattn.serve.radix import PrefixCache
from treeattn.serve.scheduler import QueueFull, Request, SamplingParams, Scheduler

__all__ = ["PrefixCache", "QueueFull", "ReplicatedScheduler", "Request", "SamplingParams", "Scheduler"]
