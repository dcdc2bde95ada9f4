"""Whether a model fits its GPUs, before vLLM finds out at start: ``models fit``, and the
same check in ``check-config`` and ``doctor`` for every model the config names.

- :mod:`appliance.fit.estimate`: the estimate itself, pure (config.json shape, weight
  bytes, GPU sizes, settings -> bytes per GPU, KV cache tokens, what to try);
- :mod:`appliance.fit.sources`: a model folder's config.json and weight files, NVML's GPU
  sizes, sizes as written ("24GiB");
- :mod:`appliance.fit.check`: a model as the config serves it, and every model of a config;
- :mod:`appliance.fit.cli`: ``llm-appliance models fit``.
"""
