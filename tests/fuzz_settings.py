"""The Hypothesis settings of every fuzz test (tests/api, tests/security).

CI runs each test's fixed, derandomized set of examples without shrinking: a failing example is reported as
drawn (shrinking it can outlast the test's timeout). ENGINE_FUZZ_EXAMPLES=N runs N random examples per test
and shrinks what fails, for a bug hunt; ENGINE_FUZZ_SHRINK=1 shrinks at the CI size.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

NUM_EXAMPLES = int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "0"))  # 0: each test's CI size
IS_SHRINKING = bool(NUM_EXAMPLES or os.environ.get("ENGINE_FUZZ_SHRINK"))


def fuzz_settings(ci_examples: int) -> settings:
    return settings(
        max_examples=NUM_EXAMPLES or ci_examples,
        derandomize=not NUM_EXAMPLES,
        phases=tuple(Phase) if IS_SHRINKING else tuple(p for p in Phase if p is not Phase.shrink),
        database=None,
        deadline=None,
        print_blob=False,
        # NOTE: one server serves every example (a module fixture): what makes an example slow is the server
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                               HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
