"""Tracer and meter providers, set up once per process.

Nothing leaves the process by default. An OTLP endpoint (flag, or the standard
OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT variables)
turns on the OTLP exporters. The Prometheus pull reader is installed unless asked
not to be: it must come with the one MeterProvider, and it computes nothing until
something scrapes (`plimsoll serve --metrics-port`, or a listener calling
`telemetry.prometheus.render()`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanProcessor

_configured = False


@dataclass
class TelemetrySettings:
    otlp_endpoint: str = ""  # empty: use the OTEL_* variables, if any
    service_name: str = "plimsoll"
    prometheus: bool = True  # install the Prometheus reader (serving it is separate)


def otlp_endpoint(settings: TelemetrySettings) -> str:
    return (
        settings.otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    )


def setup(
    settings: TelemetrySettings | None = None,
    extra_span_processors: list[SpanProcessor] | None = None,
    extra_metric_readers: list[MetricReader] | None = None,
) -> None:
    """Installs the global providers; later calls do nothing (OTel allows one set)."""
    global _configured
    if _configured:
        return
    settings = settings or TelemetrySettings()
    resource = Resource.create({SERVICE_NAME: settings.service_name})
    tracer_provider = TracerProvider(resource=resource)
    readers: list[MetricReader] = list(extra_metric_readers or [])
    endpoint = otlp_endpoint(settings)
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint)))
    if settings.prometheus:
        from telemetry.prometheus import metric_reader

        readers.append(metric_reader())
    for processor in extra_span_processors or []:
        tracer_provider.add_span_processor(processor)
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    _configured = True
