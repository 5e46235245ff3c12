"""Upstream subsystem: scheduler (``sglang.srt.managers``).

* ``SchedulerInternalStateController.get_internal_state`` (after): adds a
  ``memx`` section with live pool numbers to the internal state the scheduler
  already sends to the HTTP process on request, so /memx/status needs no new
  IPC channel.
"""

from __future__ import annotations

import logging

from sglang_memx.hooks import HookSpec
from sglang_memx.runtime import config_of
from sglang_memx.status import scheduler_status

logger = logging.getLogger("sglang_memx")


def after_get_internal_state(result, controller, *args, **kwargs):
    scheduler = controller.scheduler
    config = config_of(getattr(scheduler, "server_args", None))
    if config.disabled:
        return result
    try:
        result.internal_state["memx"] = scheduler_status(scheduler, config)
    except Exception as exc:  # never break upstream's /server_info
        logger.exception("memx: could not collect scheduler status")
        result.internal_state["memx"] = {"error": f"{type(exc).__name__}: {exc}"}
    return result


HOOKS = (
    HookSpec(
        "sglang.srt.managers.scheduler_components.internal_state."
        "SchedulerInternalStateController.get_internal_state",
        "after", after_get_internal_state, expects=("self", "recv_req"),
        why="report live KV pool numbers from the scheduler process"),
)
