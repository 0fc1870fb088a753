"""Folio's HTTP service, laid out for a reader:

- `app/api/<family>/`: one package per API a client speaks (`tgi`, `openai/completions`, `tokenizer`, `inspect`,
  `models`, `system`): `router.py` its routes, `protocol.py` its wire models (each request's `to_sampling_params`
  and the API's field names), `serving.py` (where there is one) the engine's events written as that API's JSON and
  server-sent events. `app/api/protocol.py` holds what their wire models share.
- `app/serving/`: the serving core: one `GenerationService` per model over the model registry, and the FastAPI
  dependencies that hand a request its service and engine slot.
- `app/http/`: the HTTP plumbing every route shares: the connection's bounds, body limits, admission, the API key,
  request IDs and the access log, metrics, errors, strict JSON and SSE framing.
- `main.py` builds the app; `__main__.py` and `cli.py` are the commands; `settings.py` the configuration.
"""
