"""What a worker's death most likely means, said in the arbiter's log line about it.

"worker 4242 died (signal SIGKILL)" leaves the operator to know that a SIGKILL nobody sent is
usually the kernel's OOM killer; gunicorn's arbiter says "Perhaps out of memory?", and so does
this one, for every ending it can see: the signal's number and name and its usual cause, or the
exit status and what the worker does before exiting with it.
"""

from __future__ import annotations

import signal

from .child import BOOT_ERROR

_NATIVE_CRASH = "a crash in native code (a C extension, or the interpreter itself)"
_FROM_OUTSIDE = (
    "sent from outside the farm (an operator, a script, a container runtime); "
    "signal the arbiter, which stops or replaces its workers itself"
)
_SIGNAL_CAUSES = {
    signal.SIGKILL: "out of memory? see dmesg / the OOM killer (or someone ran kill -9)",
    signal.SIGSEGV: _NATIVE_CRASH,
    signal.SIGBUS: _NATIVE_CRASH,
    signal.SIGILL: _NATIVE_CRASH,
    signal.SIGFPE: _NATIVE_CRASH,
    signal.SIGABRT: "aborted by native code (a failed assertion in a C library or extension)",
    signal.SIGTERM: _FROM_OUTSIDE,
    signal.SIGINT: _FROM_OUTSIDE,
    signal.SIGQUIT: _FROM_OUTSIDE,
    signal.SIGHUP: _FROM_OUTSIDE,
}
_STATUS_CAUSES = {
    0: "it stopped although the arbiter did not ask it to",
    1: "it crashed; its traceback is in the log above",
    BOOT_ERROR: "it could not boot; the log lines above say why",
}
_STALE = (
    "by the arbiter: its heartbeat was silent longer than --heartbeat-timeout (the stacks "
    "dumped above show where its event loop was stuck)"
)


def describe_death(code: int, *, stale: bool = False) -> str:
    """How a worker ended and its likely cause, from `os.waitstatus_to_exitcode`'s `code`.

    `stale`: the arbiter itself killed it for a silent heartbeat, which then is the cause
    whatever the signal.
    """
    if code >= 0:
        cause = _STATUS_CAUSES.get(code)
        return f"exit status {code}: {cause}" if cause else f"exit status {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"killed by signal {-code}"
    killed = f"killed by signal {-code} ({sig.name})"
    if stale:
        return f"{killed} {_STALE}"
    cause = _SIGNAL_CAUSES.get(sig)
    return f"{killed}: {cause}" if cause else killed
