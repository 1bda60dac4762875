"""spec-bench: workloads, interleaved runs, per-category report, tuning."""
