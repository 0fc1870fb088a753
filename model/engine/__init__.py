"""The inference engine: continuous batching over a preallocated KV cache, on its own thread.

- `engine.Engine`: the public API (submit / reserve / generate / cancel);
- `config.EngineConfig`: its configuration, one object handed down whole;
- `scheduler.Scheduler`: the queues, the capacity rule and the engine thread's loop (admission, prefill, decode);
- `output.OutputProcessor`: a step's logits into tokens, stops and events (sampling, stopping, prompt scores,
  speculative decoding's verification: the drafts themselves are model/speculative/'s);
- `events`: what it hands back (token events, the final result), its counters and its domain errors;
- `stream`: the hand-off to asyncio (an event stream per request, a mailbox per event loop, reservations);
- `request`, `batch`, `prefill`: one request's state, the batch (every slot and cache row), prefill packing;
- `runner.ModelRunner`: the model, its KV cache and the two forwards a step makes (a draft model gets one too;
  `memory_needed`: their bytes, before loading).
"""

from model.engine.config import EngineConfig
from model.engine.engine import Engine
from model.engine.events import (
    EngineError,
    EngineStats,
    EngineStopped,
    Event,
    Finished,
    GenerationError,
    Overloaded,
    PromptToken,
    Result,
    TokenEvent,
    TopToken,
    end_of,
)
from model.engine.request import Request
from model.engine.runner import memory_needed
from model.engine.stream import GenerationStream, Reservation

__all__ = [
    "Engine", "EngineConfig", "EngineError", "EngineStats", "EngineStopped", "Event", "Finished", "GenerationError",
    "GenerationStream", "Overloaded", "PromptToken", "Request", "Reservation", "Result", "TokenEvent", "TopToken",
    "end_of", "memory_needed",
]
