"""The model workers: the engine, its core and its model executor, with no Ray, gRPC or Redis.

`SamplingParams` is the request surface every caller may build and check before an engine
exists (as `vllm.SamplingParams`): the CLI checks its flags with it before loading a model."""

from kvserve.workers.core.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
