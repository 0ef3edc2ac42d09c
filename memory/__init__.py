"""Memory: readings, the ceiling and levels, the plans, the governor and its executor.

`memory` knows nothing of gRPC, engines or sessions: it reaches them through
the protocols in `memory.protocols`.

- `readings`, `ceiling`, `levels`, `config`: what the process holds and may hold.
- `actions`: the one vocabulary every plan returns.
- `plans/`: every memory decision as a pure plan (the tick, a load, admission,
  the OS pressure guard, the bank's dynamic ceiling, the eviction ladder's order).
- `governor`: the one loop that drives the plans and owns the policy state.
- `executor`: the one place actions touch the pool, the engines and the bank.
- `recording`: the one table from each action to its span, metric and event.
- `cadence`, `chunking`, `store_cache`: poll interval, prefill chunks, cap walk.
"""
