"""An OpenAI-compatible server over the runtime (`python -m infer.serve`): FastAPI routes (`app`), the API's bodies
(`protocol`), completions from body to response (`completions`), the engine's own thread (`engine_loop`) and
Prometheus metrics (`metrics`); `server` holds the command line and an in-process `serving` context."""
