"""Session bank and admission policies (pure policy: no gRPC, no MLX calls).

- `bank`: SessionBank, SessionEntry, shrink_to_bytes / shrink_for_admission.
- `admission`: decide / run_admission, ReservationBook, AdmissionQueue, scheduler modes.
- `pressure_guard`: the OS memory-pressure guard with hysteresis.
- `ceiling`: the bank's dynamic ceiling and `hold_to_ceiling`.
- `activity`: in-flight + pinned sessions ("active"), session pins.
"""

from .activity import ActiveSessions, SessionPin, SessionPins
from .admission import (
    AdmissionInputs,
    AdmissionOutcome,
    AdmissionQueue,
    AdmissionSlot,
    BankFigures,
    Decision,
    QueueOutcome,
    QueueResult,
    Reservation,
    ReservationBook,
    SchedulerMode,
    SchedulerSettings,
    ShedKind,
    ShedPreview,
    ShedStep,
    StepResult,
    Verdict,
    bank_figures,
    decide,
    gate,
    preview_shed,
    project_bytes,
    queue_from_settings,
    run_admission,
    validate_scheduler_settings,
)
from .bank import (
    BankStats,
    EntryInfo,
    PutResult,
    SessionBank,
    SessionEntry,
    SessionInfo,
    ShrinkPlan,
)
from .ceiling import bank_dynamic_ceiling, hold_to_ceiling
from .pressure_guard import (
    GuardResult,
    OsPressure,
    PressureAction,
    PressureGuard,
    apply_pressure_actions,
    parse_os_pressure,
)
from .trie import TokenTrie

__all__ = [
    "ActiveSessions", "AdmissionInputs", "AdmissionOutcome", "AdmissionQueue", "AdmissionSlot",
    "BankFigures", "BankStats", "Decision", "EntryInfo", "GuardResult", "OsPressure",
    "PressureAction", "PressureGuard", "PutResult", "QueueOutcome", "QueueResult",
    "Reservation", "ReservationBook", "SchedulerMode", "SchedulerSettings", "SessionBank",
    "SessionEntry", "SessionInfo", "SessionPin", "SessionPins", "ShedKind", "ShedPreview",
    "ShedStep", "ShrinkPlan", "StepResult", "TokenTrie", "Verdict", "apply_pressure_actions",
    "bank_dynamic_ceiling", "bank_figures", "decide", "gate", "hold_to_ceiling",
    "parse_os_pressure", "preview_shed", "project_bytes", "queue_from_settings",
    "run_admission", "validate_scheduler_settings",
]
