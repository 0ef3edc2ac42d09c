"""OpenTelemetry set-up and the catalogue of names (see `telemetry.names`)."""

from opentelemetry import metrics, trace

INSTRUMENTATION_NAME = "plimsoll"


def tracer() -> trace.Tracer:
    """The tracer every Plimsoll module uses (a no-op until `setup` configures one)."""
    return trace.get_tracer(INSTRUMENTATION_NAME)


def meter() -> metrics.Meter:
    """The meter every Plimsoll module uses."""
    return metrics.get_meter(INSTRUMENTATION_NAME)
