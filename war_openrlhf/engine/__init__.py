"""Rollout engines: vLLM engines whose speculation drafts from the global index and
switches on and off with measured load.

- :mod:`config`: :class:`EngineConfig` and start-up checks that name the setting to change.
- :mod:`suffix_hook`: the WAR replica behind vLLM's ``suffix`` drafter (a worker extension).
- :mod:`spec_switch`: the load-aware switch (online step-latency curve).
- :mod:`engine`: :class:`WarEngine`, one async vLLM engine (also OpenRLHF's rollout-actor surface).
- :mod:`actors`: :func:`create_war_engines`, the Ray actors.
- :mod:`tiny_model`: a small random Llama + tokenizer built locally, for tests and demos.
"""
