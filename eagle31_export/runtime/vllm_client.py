"""A client for a vLLM OpenAI-compatible server: token ids in, token ids out, and the speculative
decoding counters vLLM keeps (standard library only: urllib and a few lines of Prometheus text).

Acceptance comes from two places vLLM fills (docs/runtimes.md, "vLLM"):
- `/metrics`: the counters `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
  `..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos{position}`, read around each request;
  one request at a time, their deltas are that request's;
- the response's `metrics.speculative_decoding` when the server runs with
  `--per-request-spec-decode-metrics detailed`: the accepted count of every verification step, in order.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from eagle31_export.errors import UserError

REQUEST_TIMEOUT_S = 600.0
_SAMPLE = re.compile(r'^(vllm:spec_decode_[a-z_]+?)(?:_total)?(?:\{([^}]*)\})? ([-+0-9.eE]+|NaN|[+-]Inf)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://", url):
        url = "http://" + url
    return url


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (summed over engines); `accepted_per_position[i]`: rounds
    whose draft at position i+1 was accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda v: list(v) + [0] * (width - len(v))  # noqa: E731
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted_tokens - other.accepted_tokens,
                            [a - b for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))])


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The spec-decode counters of a Prometheus text page; None when the page has none (a server
    started without speculative decoding)."""
    counters, per_position, seen = SpecCounters(), {}, False
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match or match.group(1).endswith("_created"):
            continue
        name, labels, value = match.group(1), dict(_LABEL.findall(match.group(2) or "")), int(float(match.group(3)))
        short = name.removeprefix("vllm:spec_decode_")
        seen = True
        if short == "num_accepted_tokens_per_pos":
            position = int(labels.get("position", 0))
            per_position[position] = per_position.get(position, 0) + value
        elif short in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            attr = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens",
                    "num_accepted_tokens": "accepted_tokens"}[short]
            setattr(counters, attr, getattr(counters, attr) + value)
    if not seen:
        return None
    counters.accepted_per_position = [per_position.get(i, 0) for i in range(max(per_position, default=-1) + 1)]
    return counters


@dataclass
class Completion:
    tokens: list[int]
    finish_reason: str | None
    spec_metrics: dict | None  # the response's metrics.speculative_decoding, where the server fills it


class VllmClient:
    def __init__(self, url: str, timeout: float = REQUEST_TIMEOUT_S):
        self.url, self.timeout = base_url(url), timeout
        self._model: str | None = None

    def _request(self, path: str, body: dict | None = None, timeout: float | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"} if data else {})
        with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
            return response.read()

    def _fail(self, what: str, err: Exception) -> UserError:
        if isinstance(err, urllib.error.HTTPError):
            try:
                detail = json.loads(err.read() or b"{}").get("error", {})
                reason = detail.get("message") if isinstance(detail, dict) else str(detail)
            except ValueError:
                reason = None
            reason = (reason or err.reason or "").splitlines()[0] if (reason or err.reason) else ""
            return UserError(f"vLLM server at {self.url}: {what} answered HTTP {err.code}: {reason}")
        reason = getattr(err, "reason", None) or err
        return UserError(f"vLLM server at {self.url}: {what} failed ({reason}); is the server running?")

    def healthy(self) -> bool:
        try:
            self._request("/health", timeout=5)
            return True
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def model(self) -> str:
        """The served model's name (the first `/v1/models` entry)."""
        if self._model is None:
            try:
                models = json.loads(self._request("/v1/models", timeout=30))["data"]
                self._model = models[0]["id"]
            except (urllib.error.URLError, OSError) as err:
                raise self._fail("/v1/models", err) from None
            except (ValueError, KeyError, IndexError, TypeError):
                raise UserError(f"{self.url}/v1/models is not a vLLM model list; is this a vLLM server?") from None
        return self._model

    def spec_counters(self) -> SpecCounters | None:
        try:
            text = self._request("/metrics", timeout=30).decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as err:
            raise self._fail("/metrics", err) from None
        return parse_spec_counters(text)

    def complete(self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
                 stop_ids: tuple[int, ...] = ()) -> Completion:
        """One completion from token ids. Generation runs to `max_tokens` (or a stop id), as our own
        loop does: the model's EOS and the server's default sampling settings do not apply."""
        # No top_k / min_p / repetition_penalty, not even at their neutral values: vLLM 0.32 then takes
        # another sampling path, under which its CPU build accepted no drafts at all (docs/runtimes.md).
        body = {"model": self.model(), "prompt": list(prompt_ids), "max_tokens": max_tokens,
                "temperature": temperature, "seed": seed, "ignore_eos": True, "stop_token_ids": list(stop_ids),
                "return_token_ids": True}
        try:
            answer = json.loads(self._request("/v1/completions", body))
        except (urllib.error.URLError, OSError) as err:
            raise self._fail("/v1/completions", err) from None
        try:
            choice = answer["choices"][0]
            tokens = [int(t) for t in choice["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise UserError(f"vLLM server at {self.url}: the completion has no token_ids (vLLM older than "
                            "return_token_ids?); use a newer vLLM") from None
        spec = (answer.get("metrics") or {}).get("speculative_decoding")
        return Completion(tokens, choice.get("finish_reason"), spec)
