"""What each of the plugin's patches found, said the same way by all of them.

Every patch probes what it patches first, with one of three outcomes:
- recognised, and the defect it fixes is there: fixed;
- recognised, and healthy: left alone;
- not recognised (a moved module, another signature, a method that does something else on the probe's
  stand-ins): left alone, one log line, and its /metrics gauge says `not_recognised` with the vLLM
  version and the reason, which the parity runtime reports as "unknown on vLLM X.Y", never as healthy.

Each gauge carries the labels `vllm` (the version the probe ran on) and `reason` (what was not
recognised; empty otherwise) besides its own.
"""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.eagle31_vllm_plugin")

NOT_RECOGNISED = "not_recognised"  # the label value every gauge uses for that outcome


def vllm_version() -> str:
    """The running vLLM's version ("?" where it does not say)."""
    try:
        from vllm import __version__
    except Exception:  # noqa: BLE001 - a vLLM without the attribute is still a vLLM to report
        return "?"
    return str(__version__)


def not_recognised(what: str, reason: str) -> None:
    """The one log line of a patch left alone because what it patches is not what it knows."""
    log.warning("eagle31-vllm-plugin: %s: unknown on vLLM %s (%s); left as shipped", what, vllm_version(), reason)


def publish(metric: str, doc: str, labels: dict[str, str], reason: str = "") -> None:
    """`metric` set to 1 with `labels`, `vllm` and `reason`, on the process's Prometheus registry
    (vLLM's /metrics serves it, merged over its processes by the largest value)."""
    gauge = _gauge(metric, doc, (*labels, "vllm", "reason"))
    if gauge is not None:
        gauge.labels(**labels, vllm=vllm_version(), reason=reason).set(1)


def withdraw(metric: str, doc: str, labels: dict[str, str], reason: str = "") -> None:
    """`metric` with `labels` set back to 0 in this process (a state found not to hold after all)."""
    gauge = _gauge(metric, doc, (*labels, "vllm", "reason"))
    if gauge is not None:
        gauge.labels(**labels, vllm=vllm_version(), reason=reason).set(0)


_gauges: dict[str, object] = {}


def _gauge(metric: str, doc: str, names: tuple[str, ...]):
    if metric not in _gauges:
        try:
            from prometheus_client import Gauge
        except ImportError:
            return None
        _gauges[metric] = Gauge(metric, doc, list(names), multiprocess_mode="max")
    return _gauges[metric]
