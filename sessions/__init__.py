"""The session bank and what admission holds (pure bookkeeping: no gRPC, no MLX calls).

- `bank`: SessionBank, SessionEntry, shrink_to_bytes / shrink_for_admission.
- `trie`: the token trie the bank looks prefixes up in.
- `activity`: in-flight + pinned sessions ("active").
- `leases`: Pin leases on models and sessions.
- `reservations`: Admit tickets.
- `admission`: the bounded queue waiting for the admission gate.
- `ttl`: the one TTL map behind leases and tickets.

The decisions (shrinks, admission, the OS pressure guard, the dynamic ceiling)
are plans in `memory.plans`, run by the governor.
"""
