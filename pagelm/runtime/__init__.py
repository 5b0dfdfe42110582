"""Process plumbing every floor may use: the one place that sets thread counts (`threads`) and the
heap's reuse and trimming (`heap`)."""
