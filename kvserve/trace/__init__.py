"""`kvserve trace`'s exports of the engine's step recorder: Chrome/Perfetto trace files, a
picture of requests and KV usage on one time axis, and the step-by-step explain view."""
