"""OpenAI's HTTP API (completions, chat completions, models, health, tokenize) over a kvserve
engine: `protocol` (request bodies, errors), `serving` (the endpoints' logic), `http` (the
FastAPI app). Knows nothing of Ray: the deployment mounts the app on each replica."""
