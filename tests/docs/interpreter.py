"""One page's Python interpreter: runs the page's blocks one after another in one namespace, as
a reader pasting them into one session would.

Run as a script: reads one JSON request a line on stdin (`{"code": ..., "name": ...}`), runs
it, and answers one JSON line on the real stdout (`{"ok": true}`, or the traceback). What the
block prints goes to stderr, so it never mixes with the answers.
"""

from __future__ import annotations

import json
import sys
import traceback


def main() -> None:
    answers = sys.stdout
    sys.stdout = sys.stderr
    namespace: dict[str, object] = {"__name__": "__main__"}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            exec(compile(request["code"], request["name"], "exec"), namespace)
        except BaseException:
            answer = {"ok": False, "error": traceback.format_exc()}
        else:
            answer = {"ok": True}
        sys.stderr.flush()
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
