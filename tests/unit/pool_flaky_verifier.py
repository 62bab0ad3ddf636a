"""A verifier that misbehaves on demand, for the reward-pool tests; imported only inside pool workers (`preload`).

The response says what to do: `ok:<i>` -> correct with `<i>` extracted; `hang:<i>` sleeps forever; `crash:<i>`
raises; `exit:<i>` ends its worker with `os._exit`; `kill:<i>` sends its worker SIGKILL.
"""

import os
import signal
import time

from megarl.verifiers.base import VerifyResult, register_verifier


@register_verifier("flaky")
class FlakyVerifier:
    name = "flaky"

    def verify(self, response: str, ground_truth) -> VerifyResult:
        action, _, value = response.partition(":")
        if action == "hang":
            time.sleep(3600)
        elif action == "crash":
            raise RuntimeError(f"verifier bug on {value}")
        elif action == "exit":
            os._exit(3)
        elif action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        ok = value == str(ground_truth)
        return VerifyResult(1.0 if ok else 0.0, "correct" if ok else "incorrect", extracted=value)
