"""The engine's side of a sync as the trainer processes drive it: the weight-transfer calls
of an engine (an ``LLM`` object, or a ``vllm serve`` server's HTTP routes), each on a thread
of its own while the trainer processes do their part, and the error every trainer process
raises alike.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from typing import Any, Callable, Optional

from ..distributed import RedistributeError


class WeightSyncError(RedistributeError):
    """A weight sync that cannot run; raised on every trainer process alike, the engine left
    serving the weights it had."""


class _Client:
    """The engine's four weight-transfer calls: on an ``LLM`` object, or as the HTTP routes of
    a ``vllm serve`` server (started with ``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, engine: Any, timeout_s: float) -> None:
        self._engine = engine
        self._timeout = timeout_s

    def _post(self, route: str, body: dict[str, Any]) -> None:
        url = str(self._engine).rstrip("/") + "/" + route
        request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as reply:
                reply.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise WeightSyncError(f"{url}: HTTP {e.code}: {detail}") from e
        except OSError as e:
            raise WeightSyncError(f"{url}: {e}; is it a vllm serve server started with "
                                  "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                                  "'{\"backend\": \"reshard\"}'?") from e

    def _call(self, method: str, body: Optional[dict[str, Any]] = None) -> None:
        if isinstance(self._engine, str):
            self._post(method, body or {})
        elif body is None:
            getattr(self._engine, method)()
        else:
            getattr(self._engine, method)(body)

    def call(self, method: str, body: Optional[dict[str, Any]] = None) -> None:
        """The engine's RPC ``method``, waited for at most the sync's timeout: an ``LLM``
        whose engine hangs (a worker stopped, not dead) never answers vLLM's own call, which
        has no timeout; it is left running on a thread of its own."""
        self._within(lambda: self._call(method, body), method)

    def _within(self, fn: Callable[[], None], what: str) -> None:
        if isinstance(self._engine, str):  # the server's socket is bounded by the timeout
            fn()
            return
        call = _Background(fn)
        if not call.wait(self._timeout):
            raise WeightSyncError(f"the engine did not answer {what} within {self._timeout:g} "
                                  "s (is it hung?)")
        error = call.result()
        if error is not None:
            raise error

    def later(self, method: str, body: Optional[dict[str, Any]] = None) -> "_Background":
        """The engine's RPC on a thread of its own (it returns once the trainer processes
        have done their part; the sync bounds its wait)."""
        return _Background(lambda: self._call(method, body))

    def reset_caches(self) -> None:
        """Drops what the engine computed with the weights it had: its prefix cache (requests
        in flight are preempted and computed again) and its encoder cache."""
        if isinstance(self._engine, str):
            self._post("reset_prefix_cache?reset_running_requests=true", {})
            self._post("reset_encoder_cache", {})
            return

        def reset() -> None:
            self._engine.reset_prefix_cache(reset_running_requests=True)
            reset_encoder = getattr(getattr(self._engine, "llm_engine", None),
                                    "reset_encoder_cache", None)
            if reset_encoder is not None:
                reset_encoder()
        self._within(reset, "reset_prefix_cache")

    def tensor_parallel_size(self) -> Optional[int]:
        if isinstance(self._engine, str):
            return None
        return int(self._engine.llm_engine.vllm_config.parallel_config.tensor_parallel_size)


class _Background:
    """A call on a thread of its own, its exception kept for :meth:`result`."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._error: Optional[BaseException] = None

        def body() -> None:
            try:
                fn()
            except BaseException as e:  # handed to result()
                self._error = e
        self._thread = threading.Thread(target=body, daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout_s: float) -> bool:
        """Whether the call has returned, waiting at most ``timeout_s``."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self) -> Optional[BaseException]:
        self._thread.join()
        return self._error
