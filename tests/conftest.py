"""Shared test configuration: Hypothesis profiles (HYPOTHESIS_PROFILE=dev|ci)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

#: ``engine_fixtures`` holds the session engine and the hooks that order its tests.
pytest_plugins = ["engine_fixtures"]
