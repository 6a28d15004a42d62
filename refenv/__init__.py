"""refenv: a graded reference environment speaking GraphJin's `env serve --step` contract."""

# The task suite's version, named in /health as the dataset's anchor and the suite's version: it
# changes when the tasks or their worlds do, not with the package's release (the distribution's
# version is rollout-service's), so that rewards from two releases serving the same suite compare.
SUITE_VERSION = "refenv-0.1.0"
