"""Every memory decision as a pure plan: readings and state in, actions out.

- `tick`: the enforcer tick, with the bank's upkeep every tick.
- `load`: making room for a model load.
- `admission`: the admission gate and cascade, live or as a preview.
- `os_guard`: the OS pressure guard's hysteresis.
- `bank_ceiling`: the session bank's dynamic ceiling.
- `eviction`: the one order in which idle models are evicted.
- `model_limits`: model keep-alive, and the loaded-model count and byte limits.
- `steps`: what a plan yields to the governor and gets back.
"""
