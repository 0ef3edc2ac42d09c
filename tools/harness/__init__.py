"""Shared by the tests and the benchmarks: a library, not a tool (nothing here has a main).

* `tools.harness.server`: a Plimsoll server as a subprocess (`start_server`, `ServerProcess`).
* `tools.harness.cgroup`: a child memory cgroup to run it in (`ChildCgroup`).
* `tools.harness.report`: logging, percentiles and how busy the rest of the machine is.
* `tools.harness.generate`: prompts and concurrent `Generate` streams, timed.
* `tools.harness.profile`: py-spy's collapsed stacks, summed and printed.
"""
