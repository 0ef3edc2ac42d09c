"""The one catalogue of span, attribute and metric names.

Every span and instrument Plimsoll emits is named here, so dashboards and tests
have a single place to look.
"""

# -- spans -----------------------------------------------------------------
SPAN_GENERATE = "plimsoll.generate"
SPAN_MODEL_LOAD = "plimsoll.model.load"
SPAN_MODEL_UNLOAD = "plimsoll.model.unload"
SPAN_LEVEL_TRANSITION = "plimsoll.memory.transition"
SPAN_ENFORCER_TICK = "plimsoll.memory.tick"
SPAN_RECLAIM = "plimsoll.memory.reclaim"
SPAN_EVICT = "plimsoll.memory.evict"
SPAN_ABORT = "plimsoll.memory.abort"
SPAN_LOAD_ABORT = "plimsoll.memory.load_abort"
SPAN_BANK_SHRINK = "plimsoll.sessions.shrink"  # either policy: see ATTR_SHRINK_MODE
SPAN_ADMISSION_REFUSAL = "plimsoll.admission.refusal"
SPAN_LOAD_REFUSAL = "plimsoll.model.load_refusal"
SPAN_BANK_EXPIRE = "plimsoll.sessions.expire_idle"
SPAN_BANK_EVICT = "plimsoll.sessions.evict"  # evictions the bank makes on its own (caps, drops)
SPAN_PREFILL_ABORT = "plimsoll.memory.prefill_abort"
SPAN_COLD_SPILL = "plimsoll.sessions.cold.spill"  # a shed entry written to disk, or dropped
SPAN_COLD_RESTORE = "plimsoll.sessions.cold.restore"  # a prompt restored from disk (or not)
SPAN_COLD_COLLECT = "plimsoll.sessions.cold.collect"  # files deleted, with the reason

# -- span attributes -------------------------------------------------------
ATTR_LEVEL = "plimsoll.level"
ATTR_FROM_LEVEL = "plimsoll.from_level"
ATTR_USAGE = "plimsoll.usage_bytes"
ATTR_CEILING = "plimsoll.ceiling_bytes"
ATTR_TARGET = "plimsoll.target_bytes"
ATTR_BYTES_FREED = "plimsoll.bytes_freed"
ATTR_BYTES_AFTER = "plimsoll.bytes_after"
ATTR_ENTRIES_EVICTED = "plimsoll.entries_evicted"
ATTR_NON_TERMINAL_EVICTED = "plimsoll.non_terminal_evicted"
ATTR_TERMINAL_EVICTED = "plimsoll.terminal_evicted"
ATTR_MODEL = "plimsoll.model"
ATTR_REASON = "plimsoll.reason"
ATTR_REQUEST_ID = "plimsoll.request_id"
ATTR_REQUEST_IDS = "plimsoll.request_ids"
ATTR_PROMPT_TOKENS = "plimsoll.prompt_tokens"
ATTR_CACHED_TOKENS = "plimsoll.cached_tokens"
ATTR_COMPLETION_TOKENS = "plimsoll.completion_tokens"
ATTR_FINISH_REASON = "plimsoll.finish_reason"
ATTR_VERDICT = "plimsoll.verdict"
ATTR_PROJECTED = "plimsoll.projected_bytes"
ATTR_RECLAIM_KIND = "plimsoll.reclaim_kind"  # pressure | idle | aux_caches
ATTR_ACCEPTED = "plimsoll.accepted"  # an engine accepted a pressure reclaim
ATTR_PENDING_UNLOAD = "plimsoll.pending_unload"
ATTR_KEEP_LOADED = "plimsoll.keep_loaded"
ATTR_ABORT_KIND = "plimsoll.abort_kind"  # request | load | prefill
ATTR_EVICTION_KIND = "plimsoll.eviction_kind"  # model | session_entry
ATTR_ERROR = "plimsoll.error"
ATTR_SKIPPED = "plimsoll.skipped"  # why a decided action was not carried out
ATTR_PROTECT_ACTIVE = "plimsoll.protect_active"
ATTR_SHRINK_MODE = "plimsoll.shrink_mode"
ATTR_SHED_LINE = "plimsoll.shed_line_bytes"  # admission sheds over it
ATTR_ADMISSION_LIMIT = "plimsoll.admission_limit_bytes"  # admission refuses over it
ATTR_BINDING = "plimsoll.binding_constraint"
ATTR_TRIED = "plimsoll.tried"
ATTR_CAP = "plimsoll.cap"
ATTR_REMAINING_TOKENS = "plimsoll.remaining_tokens"
ATTR_CHUNK_TOKENS = "plimsoll.chunk_tokens"
ATTR_COLD_OUTCOME = "plimsoll.cold.outcome"  # written | dropped | restored | failed
ATTR_COLD_DROP_REASON = "plimsoll.cold.drop_reason"  # memory.plans.spill DROP_*
ATTR_COLD_BYTES = "plimsoll.cold.snapshot_bytes"  # the snapshot in RAM
ATTR_COLD_FILE_BYTES = "plimsoll.cold.file_bytes"
ATTR_COLD_ENTRIES = "plimsoll.cold.entries"
ATTR_COLD_SECONDS = "plimsoll.cold.seconds"
ATTR_COLD_TIER = "tier"  # plimsoll_session_hits_total: ram | disk | miss

# -- metrics (prefix plimsoll_) ---------------------------------------------
METRIC_MEMORY_USAGE = "plimsoll_memory_usage_bytes"
METRIC_MEMORY_CEILING = "plimsoll_memory_ceiling_bytes"
METRIC_PRESSURE_LEVEL = "plimsoll_pressure_level"
METRIC_POOL_BYTES = "plimsoll_mlx_pool_bytes"
METRIC_BANK_BYTES = "plimsoll_session_bank_bytes"
METRIC_BANK_ENTRIES = "plimsoll_session_bank_entries"
METRIC_BANK_HITS = "plimsoll_session_bank_hits_total"
METRIC_BANK_MISSES = "plimsoll_session_bank_misses_total"
METRIC_EVICTIONS = "plimsoll_evictions_total"
METRIC_ABORTS = "plimsoll_aborts_total"
METRIC_ADMISSIONS = "plimsoll_admissions_total"
METRIC_REQUESTS_RUNNING = "plimsoll_requests_running"
METRIC_REQUESTS_WAITING = "plimsoll_requests_waiting"
METRIC_TTFT = "plimsoll_time_to_first_token_seconds"
METRIC_TOKENS_GENERATED = "plimsoll_tokens_generated_total"
METRIC_TRANSITIONS = "plimsoll_pressure_transitions_total"
METRIC_SHRINKS = "plimsoll_session_shrinks_total"
METRIC_RECLAIMS = "plimsoll_reclaims_total"
METRIC_REFUSALS = "plimsoll_refusals_total"
METRIC_SOFT_MARK = "plimsoll_memory_soft_mark_bytes"
METRIC_HARD_MARK = "plimsoll_memory_hard_mark_bytes"
METRIC_RESERVED_BYTES = "plimsoll_reserved_bytes"
METRIC_MODEL_BYTES = "plimsoll_model_loaded_bytes"
METRIC_COLD_BYTES = "plimsoll_session_disk_bytes"
METRIC_COLD_ENTRIES = "plimsoll_session_disk_entries"
METRIC_COLD_WRITES = "plimsoll_session_disk_writes_total"
METRIC_COLD_WRITTEN_BYTES = "plimsoll_session_disk_written_bytes_total"
METRIC_COLD_RESTORES = "plimsoll_session_disk_restores_total"
METRIC_COLD_DROPS = "plimsoll_session_disk_drops_total"
METRIC_COLD_COLLECTED = "plimsoll_session_disk_collected_total"
METRIC_SESSION_HITS = "plimsoll_session_hits_total"  # by tier: ram | disk | miss
# by model_id and path: converted | kernel (engine/fast_prefill.py)
METRIC_PREFILL_PRODUCTS = "plimsoll_prefill_layer_products_total"
# 1, one series: which BLAS MLX's products go to (engine/blas.py BlasState), as labels
METRIC_BLAS_INFO = "plimsoll_blas_info"

# -- metric labels that are not span attributes --------------------------------
LABEL_MODEL_ID = "model_id"  # plimsoll_model_loaded_bytes, one series per loaded model
LABEL_PATH = "path"  # plimsoll_prefill_layer_products_total: converted | kernel
# plimsoll_blas_info: openblas | mkl | custom | reference | accelerate | default; the
# library's version; "true" where an optimized BLAS was loaded; threads of one call
LABEL_BLAS = "blas"
LABEL_VERSION = "version"
LABEL_OPTIMIZED = "optimized"
LABEL_THREADS = "threads"

# -- the gauges gateways route on (vLLM's names; Prometheus only, see docs/metrics.md) --
# OpenTelemetry instrument names cannot hold a colon, so telemetry.prometheus exports
# these itself, from the same figures as plimsoll_requests_* and the memory gauges.
VLLM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
