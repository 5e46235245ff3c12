"""The soak's and the fault suite's client: one request of each kind against the router, and
what it answered (``load_driver``'s client contract).

``run(model, kind, n)`` returns ``{"result", "status", "finish_reason", "tokens",
"expected_tokens", "error"}`` (``accounting.Outcome``'s fields). ``result`` is ``ok`` (an answer
came: HTTP 200 and a body or a stream that ended with ``[DONE]``; whether it answered *as asked*
-- finish_reason ``stop`` / ``length`` and the token count -- is ``accounting.judge``'s call),
``shed`` (429), ``aborted`` (the abort kind: we closed the stream), ``error`` (a 5xx or an SSE
error event naming one of the router's codes, or a refused / reset / cut connection) or
``failed`` (anything else: a 5xx without a code, an unexpected 4xx, a malformed answer, a
timeout). The OpenAI routes report ``finish_reason`` and ``usage.completion_tokens`` (streams:
the last chunk's finish_reason, the usage chunk of ``stream_options.include_usage``); native
``/generate`` its ``meta_info``; a frontend program its forks' ``meta_info``.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request

from benchmark.accounting import CONNECTION_ERRORS, CUT_DETAIL, ROUTER_ERROR_CODES, normalize_finish
from benchmark.e2e.router_proc import http_json
from benchmark.sse import DONE, data_payloads

LONG_WORDS = 150
REUSE_CONVERSATIONS = 10
CHAT_TOKENS, STREAM_TOKENS, LONG_TOKENS, REUSE_TOKENS, NATIVE_TOKENS, PROGRAM_TOKENS = 24, 32, 16, 8, 16, 8


def _openai(r: dict, asked: int) -> dict:
    """An OpenAI (chat) completion's answer fields."""
    choice = r["choices"][0]
    return {"result": "ok", "status": 200, "finish_reason": normalize_finish(choice.get("finish_reason")),
            "tokens": (r.get("usage") or {}).get("completion_tokens"), "expected_tokens": asked}  # fmt: skip


def _named(text: str) -> bool:
    return any(f'"{c}"' in text for c in ROUTER_ERROR_CODES)


class Client:
    """One request of each kind against the router at ``url`` (module docstring)."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url, timeout
        self._backends: dict[str, object] = {}
        self._lock = threading.Lock()

    def run(self, name: str, kind: str, n: int) -> dict:
        try:
            return getattr(self, f"_{kind}")(name, n)
        except urllib.error.HTTPError as exc:
            body = exc.read()[:300].decode(errors="replace")
            if exc.code == 429:
                return {"result": "shed", "status": 429, "error": f"HTTP 429: {body}"}
            named = exc.code >= 500 and _named(body)
            return {"result": "error" if named else "failed", "status": exc.code, "error": f"HTTP {exc.code}: {body}"}
        except (ConnectionError, http.client.HTTPException) as exc:  # refused, reset, cut short
            return {"result": "error", "error": f"connection: {type(exc).__name__}: {exc}"[:300]}
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ConnectionError):
                return {"result": "error", "error": f"connection: {exc.reason!r}"[:300]}
            return {"result": "failed", "error": f"URLError: {exc.reason!r}"[:300]}
        except Exception as exc:  # noqa: BLE001 - every other way a request can go wrong is a failure
            text = f"{type(exc).__name__}: {exc}"[:300]
            clear = any(c in text for c in ROUTER_ERROR_CODES + CONNECTION_ERRORS)  # e.g. a program's fork error
            return {"result": "error" if clear else "failed", "error": text}

    def _post(self, path: str, body: dict) -> dict:
        return http_json(self.url + path, body, timeout=self.timeout)

    def _chat(self, name, n):
        msg = [{"role": "user", "content": f"request {n}: tell me about memory pages"}]
        body = {"model": name, "messages": msg, "max_tokens": CHAT_TOKENS, "temperature": 0.8}
        return _openai(self._post("/v1/chat/completions", body), CHAT_TOKENS)

    def _stream(self, path: str, body: dict, stop_after: int | None = None) -> dict:
        """An SSE stream: the last finish_reason seen, the usage chunk's token count (else one
        token per content event), ``[DONE]`` (``/generate``: the last event's ``meta_info``)."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        events, finish, tokens = 0, None, None
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            for payload in data_payloads(resp):
                if payload is DONE:
                    if not events:
                        return {"result": "failed", "status": 200, "error": "stream with no event"}
                    return {"result": "ok", "status": 200, "finish_reason": finish, "tokens": tokens}
                if b'"error"' in payload:
                    text = payload[:300].decode(errors="replace")
                    return {"result": "error" if _named(text) else "failed", "status": 200, "error": text}
                events += 1
                if stop_after is not None and events >= stop_after:
                    return {"result": "aborted", "status": 200}  # leaving the with-block closes the connection
                chunk = json.loads(payload)
                usage = chunk.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    tokens = usage["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    finish = normalize_finish(choice.get("finish_reason")) or finish
        return {"result": "failed", "status": 200, "error": CUT_DETAIL}

    def _chat_stream(self, name, n):
        msg = [{"role": "user", "content": f"stream {n}: list three memory tiers"}]
        body = {"model": name, "messages": msg, "max_tokens": STREAM_TOKENS, "temperature": 0.8, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        return {**self._stream("/v1/chat/completions", body), "expected_tokens": STREAM_TOKENS}

    def _long(self, name, n):
        text = f"long {n} " + " ".join(f"p{n}_{j}" for j in range(LONG_WORDS))
        body = {"model": name, "prompt": text, "max_tokens": LONG_TOKENS, "temperature": 0}
        return _openai(self._post("/v1/completions", body), LONG_TOKENS)

    def _reuse(self, name, n):
        """A long prompt whose first LONG_WORDS words are conversation ``n % REUSE_CONVERSATIONS``'s."""
        c = n % REUSE_CONVERSATIONS
        text = f"conversation {c} " + " ".join(f"c{c}_{j}" for j in range(LONG_WORDS)) + f" turn {n}:"
        body = {"model": name, "prompt": text, "max_tokens": REUSE_TOKENS, "temperature": 0}
        return _openai(self._post("/v1/completions", body), REUSE_TOKENS)

    def _generate(self, name, n):
        body = {"text": f"native {n}", "sampling_params": {"max_new_tokens": NATIVE_TOKENS, "temperature": 0}}
        meta = self._post(f"/models/{name}/generate", body)["meta_info"]
        return {"result": "ok", "status": 200, "finish_reason": normalize_finish(meta.get("finish_reason")),
                "tokens": meta.get("completion_tokens"), "expected_tokens": NATIVE_TOKENS}  # fmt: skip

    def _abort(self, name, n):
        body = {"model": name, "prompt": f"abort {n}", "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        return self._stream("/v1/completions", body, stop_after=2)

    def _program(self, name, n):
        import sglang as sgl

        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = self._backends[name] = sgl.RuntimeEndpoint(f"{self.url}/models/{name}")
        metas: list[dict] = []

        @sgl.function
        def branches(s, topic):
            s += f"Topic {topic}:"
            forks = s.fork(2)
            for i, f in enumerate(forks):
                f += f" angle {i}:" + sgl.gen("x", max_tokens=PROGRAM_TOKENS, temperature=0)
            for f in forks:
                f.sync()
            errors = [f.error() for f in forks if f.error() is not None]
            if errors:  # the frontend logs a fork's HTTP error and leaves its variable unset
                raise RuntimeError(f"fork failed: {errors[0]!r}")
            metas.extend(f.get_meta_info("x") or {} for f in forks)
            s += forks[0]["x"] + forks[1]["x"]

        branches.run(topic=str(n), backend=backend)
        return program_answer(metas, PROGRAM_TOKENS)


def program_answer(metas: list[dict], asked: int) -> dict:
    """A program's answer from its forks' ``meta_info``: ``length`` only if every fork ran to its
    limit, else the first other reason (``stop``, or ``abort`` ...); tokens summed."""
    reasons = [normalize_finish(m.get("finish_reason")) for m in metas]
    finish = next((r for r in reasons if r != "length"), "length") if reasons else None
    tokens = [m.get("completion_tokens") for m in metas]
    total = sum(tokens) if tokens and None not in tokens else None
    return {"result": "ok", "status": 200, "finish_reason": finish, "tokens": total,
            "expected_tokens": asked * len(metas)}  # fmt: skip
