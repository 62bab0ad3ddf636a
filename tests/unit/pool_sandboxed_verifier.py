"""A verifier that reports sandbox costs as the `code` verifier does, for the reward-pool test that they cross the
worker boundary; imported only inside pool workers (`preload`). The response `"<tests> <cpu seconds>"` is what it
reports; `"none"` reports nothing ran in a sandbox."""

from megarl.verifiers.base import VerifyResult, register_verifier


@register_verifier("fake_sandboxed")
class FakeSandboxed:
    name = "fake_sandboxed"

    def verify(self, response: str, ground_truth) -> VerifyResult:
        if response == "none":
            return VerifyResult(0.0, "no_answer")
        tests, cpu = response.split()
        return VerifyResult(1.0, "correct", tests_run=int(tests), sandbox_cpu_seconds=float(cpu))
