"""war-openrlhf: workload-aware rollouts for synchronous agentic RL with OpenRLHF.

Sub-packages, one concept each:

- ``speculation``: the global suffix index (completed-sequence log + replicas on
  arctic-inference's C++ suffix tree) and the proposers it is compared with.
- ``engine``: vLLM engines (Ray actors) whose drafter is an index replica, with a
  load-aware speculation switch.
- ``dispatch``: turn dispatch policies (WAR's cache-aware policy and its peers).
- ``traces``: OpenAI-chat agent traces, validated and tokenized into turns.
- ``simulation``: replays of synchronous GRPO steps over traces.
- ``metrics``: result tables and JSON reports shared by the benchmarks.
"""

__version__ = "0.1.0"
