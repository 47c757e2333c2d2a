"""The fleet twin report's fixed top-level keys (issue 19, item 4), written out once for
the tests that check a report has exactly them."""

REPORT_KEYS = frozenset(
    {
        "policy",
        "seed",
        "days",
        "nodes",
        "gpus",
        "gpu_hours_available",
        "gpu_hours_busy",
        "gpu_hours_down",
        "utilisation",
        "goodput_gpu_hours",
        "ettr",
        "interruptions",
        "interruptions_per_job_month",
        "stragglers",
        "placement",
        "sync",
        "allocation",
        "tenants",
        "elastic",
        "queue_wait_s",
        "jobs",
        "failure_model",
        "policy_parameters",
        "workload",
        "decisions",
        "events",
    }
)
