"""The trainer's compile-health watch: after warm-up, nothing new may compile and flex attention
must run compiled (rule 1 of the house). Used by drafter and target ranks alike."""

from __future__ import annotations

HEALTH_WARMUP_STEPS, HEALTH_CHECK_STEPS = 2, 2  # compile during the first, verify over the next


class CompileHealthWatch:
    """After warm-up, verify that no step compiles anything new and that flex attention runs
    compiled (no eager fallback); then forbid recompiles for the rest of the run. Fails loudly."""

    def __init__(self, enabled: bool, expect_flex: bool, start_step: int, log):
        self.enabled, self.expect_flex, self.log = enabled, expect_flex, log
        self.before = None
        self.warm_at = start_step + HEALTH_WARMUP_STEPS
        self.check_at = self.warm_at + HEALTH_CHECK_STEPS
        if enabled:
            from dflash_train.diagnostics.compile_health import track_eager_flex_calls

            track_eager_flex_calls()

    def after_step(self, step: int, last: bool) -> None:
        if not self.enabled:
            return
        from dflash_train.diagnostics import compile_health as ch

        if step == self.warm_at:
            self.before = ch.CompileCounters.snapshot()
        elif self.before is not None and (step == self.check_at or last):
            report = ch.assert_compile_healthy(self.before, ch.CompileCounters.snapshot(),
                                               expect_compiled_flex=self.expect_flex)
            frozen = ch.freeze_compilation()
            self.log(f"compile health: OK after warm-up ({report.summary()}); recompiles "
                     f"{'now forbidden' if frozen else 'not forbidden (no set_stance in this torch)'}")
            self.before = None
