"""refenv: a graded reference environment speaking GraphJin's `env serve --step` contract."""

__version__ = "0.1.0"
